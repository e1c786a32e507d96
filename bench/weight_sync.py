"""Weight-sync benchmark: 1 sender -> 2 receivers over gloo, ~1 GiB in ~300 tensors (many small ones).

Compared in one run, round by round (each round times every contender once, so all see the same noise on
a shared machine, and rounds alternate whether the baselines or DCS go first; see ../shared/BENCHMARKS.md):
  flat              one torch.distributed broadcast of a pre-allocated flat buffer of the same bytes (limit)
  per_tensor        one blocking broadcast per tensor (what a naive sender does)
  per_tensor_async  all per-tensor broadcasts issued async, then waited (SGLang's receive pattern)
  dcs               `CheckpointEngineClient.update_weights_for_rollout` end to end: topology from the
                    coordinator, HTTP meta (SGLang's API) to two real `dcs receiver` servers, packing
                    overlapped with the broadcasts, atomic commit on the receivers
The baselines run in three raw gloo processes (one sender, two receivers) that wait between rounds.
The first two rounds are warm-ups; the figure is the median of the next --repeats. Prints ratios and
writes bench/results/weight_sync.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist

MiB = 1024 * 1024
RESULTS = Path(__file__).resolve().parent / "results" / "weight_sync.json"
WARMUPS = 2
BASELINES = ("flat", "per_tensor", "per_tensor_async")


def make_state(size_mb: int, tensors: int) -> dict[str, torch.Tensor]:
    """`tensors` tensors, 5/6 of them small (1 KiB - 256 KiB, fp32 and bf16), the rest sharing the bulk."""
    small_n = tensors * 5 // 6
    state: dict[str, torch.Tensor] = {}
    for i in range(small_n):
        nbytes = 1024 * 2 ** (i % 9)
        dtype = torch.bfloat16 if i % 2 else torch.float32
        state[f"small.{i}"] = torch.full((nbytes // dtype.itemsize,), float(i % 7), dtype=dtype)
    used = sum(t.numel() * t.element_size() for t in state.values())
    big_n = tensors - small_n
    per_big = max((size_mb * MiB - used) // big_n // 4, 1)
    for i in range(big_n):
        state[f"big.{i}"] = torch.full((per_big,), float(i), dtype=torch.float32)
    return state


def total_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def baseline_rank(args: argparse.Namespace) -> None:
    """One rank of the raw-gloo baselines: per round (signalled through the control store), time each mode."""
    from dcs_tasks.backends.process_group import new_group

    control = dist.TCPStore("127.0.0.1", args.control_port, is_master=False, timeout=timedelta(seconds=1800))
    pg = new_group("gloo", "127.0.0.1", args.port, 3, args.baseline_rank, "bench", 120, 600)
    state = make_state(args.size_mb, args.tensors)
    flat = torch.zeros(total_bytes(state), dtype=torch.uint8)
    tensors = list(state.values())

    def flat_once() -> None:
        dist.broadcast(flat, 0, group=pg)

    def per_tensor_once() -> None:
        for t in tensors:
            dist.broadcast(t, 0, group=pg)

    def per_tensor_async_once() -> None:
        for work in [dist.broadcast(t, 0, group=pg, async_op=True) for t in tensors]:
            work.wait()

    modes: dict[str, Callable[[], None]] = {
        "flat": flat_once,
        "per_tensor": per_tensor_once,
        "per_tensor_async": per_tensor_async_once,
    }
    for rnd in range(args.repeats + WARMUPS):
        control.wait([f"go{rnd}"])
        times = {}
        for name, once in modes.items():
            dist.barrier(group=pg)
            t0 = time.perf_counter()
            once()
            dist.barrier(group=pg)
            times[name] = time.perf_counter() - t0
        if args.baseline_rank == 0:
            control.set(f"done{rnd}", json.dumps(times))
    control.wait(["quit"])  # exiting frees GiBs: not while the driver still times DCS


class Baselines:
    """The three baseline processes, driven round by round from this process."""

    def __init__(self, args: argparse.Namespace) -> None:
        from tests.helpers.ports import free_port

        port = free_port()
        self.control = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=1800)
        )
        cmd = [
            sys.executable,
            __file__,
            "--size-mb",
            str(args.size_mb),
            "--tensors",
            str(args.tensors),
            "--repeats",
            str(args.repeats),
            "--port",
            str(port),
            "--control-port",
            str(self.control.port),
            "--baseline-rank",
        ]
        self.procs = [subprocess.Popen([*cmd, str(rank)]) for rank in range(3)]

    def round(self, rnd: int) -> dict[str, float]:
        self.control.set(f"go{rnd}", "1")
        self.control.wait([f"done{rnd}"])
        return json.loads(self.control.get(f"done{rnd}"))

    def close(self) -> None:
        self.control.set("quit", "1")
        for proc in self.procs:
            if proc.wait(timeout=120):
                raise RuntimeError("a baseline rank failed")


async def run(args: argparse.Namespace, tmp: Path) -> tuple[dict[str, list[float]], dict[str, object]]:
    from dcs_tasks.client.engine import CheckpointEngineClient
    from dcs_tasks.config import DCSConfig
    from tests.distributed.sync_stack import sync_stack
    from tests.helpers.redis_server import RedisServer

    redis = RedisServer(tmp / "redis")
    redis.start()
    config = DCSConfig(
        redis_url=redis.url,
        node_name="benchhost",
        enable_metrics=False,
        bucket_size_bytes=args.bucket_mb * MiB,
        heartbeat_interval_seconds=1.0,
        heartbeat_timeout_seconds=10.0,
    )
    times: dict[str, list[float]] = {name: [] for name in (*BASELINES, "dcs")}
    baselines = Baselines(args)
    try:
        with sync_stack(config, tmp, receivers=2) as stack:
            state = make_state(args.size_mb, args.tensors)
            client = CheckpointEngineClient(
                coordinator_url=stack.url, role="actor", rank=0, model=state, model_name="bench", config=stack.config
            )
            await client.start()
            last: dict[str, object] = {}
            try:
                for rnd in range(args.repeats + WARMUPS):
                    if rnd % 2:  # alternate who goes first: whoever runs second pays for the first's wake
                        last = (await client.update_weights_for_rollout(rollout_only=True))["rollout"]
                        base = await asyncio.to_thread(baselines.round, rnd)
                    else:
                        base = await asyncio.to_thread(baselines.round, rnd)
                        last = (await client.update_weights_for_rollout(rollout_only=True))["rollout"]
                    if rnd >= WARMUPS:  # warm-ups touch every receive buffer on both sides
                        for name in BASELINES:
                            times[name].append(base[name])
                        times["dcs"].append(float(last["total_seconds"]))  # type: ignore[arg-type]
                digests = [r.digest() for r in stack.receivers]
            finally:
                await client.stop()
            assert all(d.weight_version == args.repeats + WARMUPS for d in digests), "receivers missed an update"
            return times, last
    finally:
        baselines.close()
        redis.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--tensors", type=int, default=300)
    parser.add_argument("--bucket-mb", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--baseline-rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--control-port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    if args.baseline_rank is not None:
        baseline_rank(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        times, dcs_metrics = asyncio.run(run(args, Path(tmp)))
    nbytes = total_bytes(make_state(args.size_mb, args.tensors))
    med = {name: statistics.median(values) for name, values in times.items()}
    ratio = {f"{name}_vs_flat": med["flat"] / med[name] for name in ("per_tensor", "per_tensor_async", "dcs")}
    result = {
        "bytes": nbytes,
        "tensors": args.tensors,
        "receivers": 2,
        "backend": "gloo",
        "bucket_mb": args.bucket_mb,
        "repeats": args.repeats,
        "warmups": WARMUPS,
        "seconds": times,
        "median_seconds": med,
        "gb_per_s": {name: nbytes / value / 1e9 for name, value in med.items()},
        **ratio,
        "dcs_last_update_metrics": dcs_metrics,
        "target": "dcs_vs_flat >= 0.9",
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, default=str))
    print(
        f"weight_sync {nbytes / MiB:.0f} MiB in {args.tensors} tensors -> 2 receivers (gloo), median of "
        f"{args.repeats} interleaved rounds: flat {med['flat']:.3f}s ({result['gb_per_s']['flat']:.2f} GB/s), "
        f"per-tensor {med['per_tensor']:.3f}s ({ratio['per_tensor_vs_flat']:.2f}x flat), "
        f"per-tensor async {med['per_tensor_async']:.3f}s ({ratio['per_tensor_async_vs_flat']:.2f}x flat), "
        f"dcs end-to-end {med['dcs']:.3f}s ({ratio['dcs_vs_flat']:.2f}x flat; target >= 0.9x)"
    )


if __name__ == "__main__":
    main()
