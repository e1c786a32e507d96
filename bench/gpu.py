"""Checkpoints onto and off one GPU: DCS against the link's floors and DCP, in one run.

State: ~`--size-gib` GiB (default 4) of a training state, `--layers` layers each with a bf16 weight and two fp32
AdamW moments (603 tensors by default), on the GPU when CUDA is there.
  floors   pinned device-to-host and host-to-device copies of the same bytes (pre-allocated page-locked memory);
           on CPU: memcpy into a resident buffer, and reading the saved files into new host memory
  save     Checkpointer.save stall, plain and `overlap=True` (its copies beside a forward-like kernel), and time
           to durable; DCP async_save stall in its default and its best configuration (pinned memory, thread
           executor)
  restore  restore into existing tensors (CUDA tensors on a GPU) from storage with the page cache warm and dropped,
           from this host's memory tier (a fresh Checkpointer, sealed tmpfs files), and from S3 with
           `--s3-bucket` (the server AWS_ENDPOINT_URL names); dcp.load into the same tensors
Every restore is checked bit-exact against the saved state. Without CUDA only the CPU figures are measured, and
the result says so (`cuda.measured` false, with the reason; the same line on stdout): GPU figures never come from a
CPU run. Writes bench/results/gpu/<UTC start>.json (or `--out`) through bench/harness.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.harness import Row, Run, start_redis, start_worker, stop
from bench.save import Memcpy, cold_median, dcp_async, init_dist, median_of
from dcs_tasks import Checkpointer
from dcs_tasks.checkpoint.format.layout import step_dir_name
from dcs_tasks.config import DCSConfig

GiB = 1 << 30
MiB = 1 << 20


def make_state(size_gib: float, layers: int, device: torch.device) -> dict[str, torch.Tensor]:
    """`layers` x (bf16 weight, fp32 exp_avg, fp32 exp_avg_sq): 10 bytes per parameter."""
    per = max(64, int(size_gib * GiB) // 10 // layers // 64 * 64)  # whole cache lines: every tensor stays aligned
    g = torch.Generator().manual_seed(0)
    state: dict[str, torch.Tensor] = {}
    for i in range(layers):
        state[f"model.layers.{i}.weight"] = torch.randn(per, generator=g).to(torch.bfloat16).to(device)
        state[f"optim.{i}.exp_avg"] = torch.randn(per, generator=g).to(device)
        state[f"optim.{i}.exp_avg_sq"] = torch.rand(per, generator=g).to(device)
    return state


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def synced(fn: Callable[[], Any]) -> Callable[[], Any]:
    def run() -> Any:
        out = fn()
        sync()
        return out

    return run


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


# --- floors ----------------------------------------------------------------------------------------------------
def cuda_floors(state: dict[str, torch.Tensor], repeats: int) -> dict[str, float]:
    """Pinned device-to-host and host-to-device copies of every tensor (pre-allocated page-locked memory)."""
    host: dict[str, torch.Tensor] = {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for k, t in state.items()}

    def d2h() -> None:
        for k, t in state.items():
            host[k].copy_(t, non_blocking=True)

    def h2d() -> None:
        for k, t in state.items():
            t.copy_(host[k], non_blocking=True)

    return {"d2h_pinned_s": median_of(synced(d2h), repeats), "h2d_pinned_s": median_of(synced(h2d), repeats)}


def cpu_floors(state: dict[str, torch.Tensor], repeats: int) -> dict[str, float]:
    """memcpy into a resident buffer (bench/save.py's `Memcpy`: torch `copy_` and threaded memmove, the faster)."""
    copies = Memcpy(state).limits(repeats)
    return {"memcpy_s": min(copies.values()), **copies}


def read_floor(root: Path, repeats: int) -> dict[str, float]:
    """Reading the saved files into new host memory: warm (page cache) and dropped."""
    files = [p for p in root.rglob("*.safetensors") if p.is_file()]
    if not files:
        raise FileNotFoundError(f"no checkpoint files under {root} to read")

    def read() -> int:
        return sum(len(p.read_bytes()) for p in files)

    warm = median_of(read, repeats)
    cold = cold_median(read, root, repeats)
    return {"read_warm_s": warm, "read_cold_s": cold, "read_bytes": float(read())}


# --- DCS -------------------------------------------------------------------------------------------------------
def make_config(root: Path, redis_url: str, total: int) -> DCSConfig:
    """One config for the worker and every checkpointer: storage under `root`, the memory tier on /dev/shm (the
    storage figures' saves are durable and their memory copies removed before those restores)."""
    base = DCSConfig(
        redis_url=redis_url,
        node_name="benchhost",
        checkpoint_dir=root / "ours",
        staging_dir=Path(tempfile.mkdtemp(prefix="dcs-bench-gpu-", dir="/dev/shm")),
        enable_metrics=False,
        incremental_saves=False,
    )
    memory = base.model_copy(
        update={
            "memory_tier_bytes": 4 * total + 256 * MiB,
            "memory_keep_last": 1,
            "memory_dir": Path(tempfile.mkdtemp(prefix="dcs-bench-gpu-mem-", dir="/dev/shm")),
            "storage_every_steps": 1_000_000,
        }
    )
    return memory


def forward_like(state: dict[str, torch.Tensor]) -> None:
    """Work that reads the weights (as a forward pass does) while an overlapped save copies them."""
    for name, t in state.items():
        if name.startswith("model."):
            t.float().square().sum()


def dcs_save(ckpt: Checkpointer, state: dict[str, torch.Tensor], repeats: int) -> dict[str, float]:
    stalls, durable, overlapped = [], [], []
    step = 0
    for i in range(repeats + 1):
        step += 1
        sync()
        start = time.perf_counter()
        pending = ckpt.save(state, step=step, durable=True)
        pending.wait(timeout=1800)
        if i:
            stalls.append(pending.stall_seconds)
            durable.append(time.perf_counter() - start)
    for i in range(repeats + 1):
        step += 1
        sync()
        pending = ckpt.save(state, step=step, overlap=True, durable=True)
        forward_like(state)
        pending.wait_staged(600)
        pending.wait(timeout=1800)
        if i:
            overlapped.append(pending.stall_seconds)
    return {
        "stall_s": statistics.median(stalls),
        "overlap_stall_s": statistics.median(overlapped),
        "durable_s": statistics.median(durable),
        "last_step": float(step),
    }


def dcs_restore(
    config: DCSConfig, memory: DCSConfig, state: dict[str, torch.Tensor], step: int, repeats: int
) -> dict[str, Any]:
    into = {k: torch.empty_like(t) for k, t in state.items()}
    manifest = Path(str(config.checkpoint.dir)) / "bench" / step_dir_name(step) / "manifest.json"
    deadline = time.monotonic() + 1800
    while not manifest.exists():  # a durable step is committed in memory first, then flushed to storage
        if time.monotonic() > deadline:
            raise TimeoutError(f"step {step} never reached storage ({manifest})")
        time.sleep(0.05)
    shutil.rmtree(Path(config.host.memory_dir) / "bench", ignore_errors=True)  # storage's copy only
    with Checkpointer("bench", config) as ckpt:
        warm = median_of(synced(lambda: ckpt.restore(step=step, into=into)), repeats)
        assert same(state, into)
        cold = cold_median(
            synced(lambda: ckpt.restore(step=step, into=into)), Path(str(config.checkpoint.dir)), repeats
        )
        assert same(state, into)
        warm_noverify = median_of(synced(lambda: ckpt.restore(step=step, into=into, verify=False)), repeats)
    with Checkpointer("bench-mem", memory) as ckpt:
        ckpt.save(state, step=1, durable=False).wait(timeout=1800)
    into = {k: torch.empty_like(t) for k, t in state.items()}
    with Checkpointer("bench-mem", memory) as fresh:  # a fresh checkpointer, as after a restart
        from_memory = median_of(synced(lambda: fresh.restore(step=1, into=into)), repeats)
        location = fresh.restore(step=1, into=into).location
    assert same(state, into) and location == "memory", location
    return {
        "restore_warm_s": warm,
        "restore_cold_s": cold,
        "restore_warm_noverify_s": warm_noverify,
        "restore_memory_s": from_memory,
    }


def s3_restore(
    state: dict[str, torch.Tensor], root: Path, redis_url: str, bucket: str, repeats: int, workers: int
) -> dict[str, Any]:
    """Restore into the same kind of tensors from S3 (AWS_ENDPOINT_URL and the AWS credentials name the server): one
    save through a worker of its own (node `benchhost-s3`), then verified restores, ranged GETs into the ring."""
    config = DCSConfig(
        redis_url=redis_url,
        node_name="benchhost-s3",
        checkpoint_dir=f"s3://{bucket}/dcs-bench-gpu-{uuid.uuid4().hex[:8]}",
        s3_endpoint_url=os.environ["AWS_ENDPOINT_URL"],
        s3_addressing_style="path",
        staging_dir=Path(tempfile.mkdtemp(prefix="dcs-bench-gpu-s3-", dir="/dev/shm")),
        enable_metrics=False,
        incremental_saves=False,
    )
    worker = start_worker(config, root / "worker-s3.log", concurrency=workers)
    into = {k: torch.empty_like(t) for k, t in state.items()}
    try:
        with Checkpointer("bench-s3", config) as ckpt:  # its own run name: the same Redis holds "bench"
            ckpt.save(state, step=1).wait(timeout=1800)
            seconds = median_of(synced(lambda: ckpt.restore(step=1, into=into)), repeats)
        assert same(state, into)
    finally:
        stop(worker)
        shutil.rmtree(config.host.staging_dir, ignore_errors=True)
    return {"measured": True, "restore_s": seconds, "endpoint": config.s3.endpoint_url}


def dcp_load_into(state: dict[str, torch.Tensor], root: Path, repeats: int) -> dict[str, float]:
    import torch.distributed.checkpoint as dcp

    target = root / "dcp-load"
    dcp.save(state, checkpoint_id=str(target))
    into = {k: torch.empty_like(t) for k, t in state.items()}
    warm = median_of(synced(lambda: dcp.load(into, checkpoint_id=str(target))), repeats)
    cold = cold_median(synced(lambda: dcp.load(into, checkpoint_id=str(target))), target, repeats)
    assert same(state, into)
    shutil.rmtree(target)
    return {"load_warm_s": warm, "load_cold_s": cold}


def dcp_saves(state: dict[str, torch.Tensor], root: Path, repeats: int) -> dict[str, Any]:
    """async_save's default, and its best configuration: on CUDA pinned staging memory with the thread executor
    (the fastest measured on the H200), on CPU bench/save.py's (process executor, shared-memory stager)."""
    init_dist()
    if not state_on_cuda(state):
        return {
            "default": dcp_async(state, root, repeats, best=False),
            "best": dcp_async(state, root, repeats, best=True),
        }
    return {
        "default": dcp_cuda(state, root, repeats, pinned=False),
        "best": dcp_cuda(state, root, repeats, pinned=True),
    }


def dcp_cuda(state: dict[str, torch.Tensor], root: Path, repeats: int, pinned: bool) -> dict[str, float]:
    """Stall = until async_save returns; durable = until its upload completes (thread executor)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    kwargs: dict[str, Any] = {}
    if pinned:
        kwargs["async_stager"] = DefaultStager(StagingOptions(True, False, False, False))
    stalls, durable = [], []
    for i in range(repeats + 1):
        target = root / f"dcp-cuda-{'best' if pinned else 'default'}-{i}"
        sync()
        start = time.perf_counter()
        result = dcp.async_save(state, checkpoint_id=str(target), **kwargs)
        staged = time.perf_counter()
        future: Any = getattr(result, "upload_completion", result)
        future.result()
        if i:
            stalls.append(staged - start)
            durable.append(time.perf_counter() - start)
        shutil.rmtree(target)
    if "async_stager" in kwargs:
        kwargs["async_stager"].close()
    return {"stall_s": statistics.median(stalls), "durable_s": statistics.median(durable)}


# --- one run ---------------------------------------------------------------------------------------------------
def measure(
    state: dict[str, torch.Tensor], root: Path, repeats: int, workers: int, s3_bucket: str | None = None
) -> dict[str, Any]:
    total = nbytes(state)
    out: dict[str, Any] = {"floors": cpu_floors(state, repeats) if not state_on_cuda(state) else {}}
    if state_on_cuda(state):
        out["floors"].update(cuda_floors(state, repeats))
    (root / "redis").mkdir(parents=True, exist_ok=True)
    redis, redis_url = start_redis(root / "redis")
    config = memory = make_config(root, redis_url, total)
    worker = start_worker(config, root / "worker.log", concurrency=workers)
    try:
        with Checkpointer("bench", config, size_hint_bytes=total + 64 * MiB) as ckpt:
            reservation = ckpt.reservation
            if reservation is not None:
                reservation.wait()
                out["reserve"] = {"alloc_s": reservation.alloc_seconds, "pin_s": reservation.pin_seconds}
            out["save"] = dcs_save(ckpt, state, repeats)
        out["restore"] = dcs_restore(config, memory, state, int(out["save"]["last_step"]), repeats)
        last = Path(str(config.checkpoint.dir)) / "bench" / step_dir_name(int(out["save"]["last_step"]))
        out["floors"].update(read_floor(last, repeats))  # the step restored above, in storage by then
        if s3_bucket is not None:
            out["s3"] = s3_restore(state, root, redis_url, s3_bucket, repeats, workers)
    finally:
        stop(worker)
        stop(redis)
        shutil.rmtree(config.host.staging_dir, ignore_errors=True)
        shutil.rmtree(config.host.memory_dir, ignore_errors=True)
    out["dcp"] = dcp_saves(state, root, repeats)
    out["dcp"]["load"] = dcp_load_into(state, root, repeats)
    return out


def state_on_cuda(state: dict[str, torch.Tensor]) -> bool:
    return any(t.is_cuda for t in state.values())


def rows(r: dict[str, Any], cuda: bool) -> list[Row]:
    f, s, rs, d = r["floors"], r["save"], r["restore"], r["dcp"]
    where = "CUDA" if cuda else "CPU"
    save_floor = f["d2h_pinned_s"] if cuda else f["memcpy_s"]
    best_dcp = min(d["default"]["stall_s"], d["best"]["stall_s"])
    out = [
        Row(
            what=f"save stall ({where} state)",
            ours=f"{s['stall_s'] * 1e3:.0f} ms",
            compared=f"{'pinned D2H' if cuda else 'memcpy'} {save_floor * 1e3:.0f} ms; DCP async_save "
            f"{d['default']['stall_s'] * 1e3:.0f} / {d['best']['stall_s'] * 1e3:.0f} ms (default / best)",
            ratio=s["stall_s"] / save_floor,
            ratio_text=f"{s['stall_s'] / save_floor:.2f}x the floor; "
            f"{best_dcp / s['stall_s']:.1f}x less than DCP's best",
            target="<= 1.1x the pinned D2H floor" if cuda else "",
            met=(s["stall_s"] / save_floor <= 1.1) if cuda else None,
        ),
        Row(
            what=f"overlapped save stall ({where} state)",
            ours=f"{s['overlap_stall_s'] * 1e3:.0f} ms",
            compared=f"floor {save_floor * 1e3:.0f} ms",
            ratio=s["overlap_stall_s"] / save_floor,
            ratio_text=f"{s['overlap_stall_s'] / save_floor:.2f}x the floor",
            target="<= 0.25x the pinned D2H floor" if cuda else "",
            met=(s["overlap_stall_s"] / save_floor <= 0.25) if cuda else None,
        ),
        Row(
            what=f"restore into existing {where} tensors, cache warm",
            ours=f"{rs['restore_warm_s'] * 1e3:.0f} ms",
            compared=f"read into host memory {f['read_warm_s'] * 1e3:.0f} ms; dcp.load "
            f"{d['load']['load_warm_s'] * 1e3:.0f} ms",
            ratio=d["load"]["load_warm_s"] / rs["restore_warm_s"],
            ratio_text=f"{d['load']['load_warm_s'] / rs['restore_warm_s']:.2f}x faster than dcp.load",
        ),
        Row(
            what=f"restore into existing {where} tensors, cache dropped",
            ours=f"{rs['restore_cold_s'] * 1e3:.0f} ms",
            compared=f"read {f['read_cold_s'] * 1e3:.0f} ms; dcp.load {d['load']['load_cold_s'] * 1e3:.0f} ms",
            ratio=f["read_cold_s"] / rs["restore_cold_s"],
            ratio_text=f"{f['read_cold_s'] / rs['restore_cold_s']:.2f}x the read speed",
        ),
        Row(
            what=f"restore from the memory tier into {where} tensors",
            ours=f"{rs['restore_memory_s'] * 1e3:.0f} ms",
            compared=f"pinned H2D {f['h2d_pinned_s'] * 1e3:.0f} ms" if cuda else f"memcpy {f['memcpy_s'] * 1e3:.0f} ms",
        ),
    ]
    if r.get("s3", {}).get("measured"):
        out.append(
            Row(
                what=f"restore from S3 into existing {where} tensors",
                ours=f"{r['s3']['restore_s'] * 1e3:.0f} ms",
                compared=f"from storage, cache warm {rs['restore_warm_s'] * 1e3:.0f} ms",
            )
        )
    return out


def main() -> None:
    bench_run = Run("gpu")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gib", type=float, default=4.0)
    parser.add_argument("--layers", type=int, default=201, help="layers of (bf16 weight, 2 fp32 moments)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=16, help="`dcs worker` concurrency")
    parser.add_argument("--dir", type=Path, default=None, help="where files are written (default: a temp dir)")
    parser.add_argument(
        "--s3-bucket",
        default=None,
        help="a bucket for the restore-from-S3 figure, on the server AWS_ENDPOINT_URL names (credentials from the AWS "
        "environment; `python -m tests.helpers.s3server -- ...` runs one)",
    )
    parser.add_argument("--out", type=Path, default=None, help="result file (default bench/results/gpu/<start>.json)")
    args = parser.parse_args()
    if args.s3_bucket is not None and not os.environ.get("AWS_ENDPOINT_URL"):
        parser.error("--s3-bucket needs AWS_ENDPOINT_URL (and the AWS credentials) set to the S3 server")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda") if cuda else torch.device("cpu")
    root = Path(tempfile.mkdtemp(prefix="dcs-bench-gpu-", dir=args.dir))
    state = make_state(args.size_gib, args.layers, device)
    results: dict[str, Any] = {
        "bytes": nbytes(state),
        "tensors": len(state),
        "repeats": args.repeats,
        "torch": torch.__version__,
        "cuda": {
            "measured": cuda,
            "reason": "" if cuda else "torch.cuda.is_available() is False: the CUDA figures were not measured",
            "device": torch.cuda.get_device_name() if cuda else None,
            "version": torch.version.cuda,
        },
        "s3": {"measured": False, "reason": "no --s3-bucket given"},
    }
    started = time.perf_counter()
    try:
        results.update(measure(state, root, args.repeats, args.workers, args.s3_bucket))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    results["seconds"] = time.perf_counter() - started
    notes = "" if cuda else "CPU run: the CUDA figures (floors, stalls, restores into CUDA tensors) were not measured"
    table = rows(results, cuda)
    # Without CUDA the README's one line says so instead of a CPU ratio that reads like a GPU figure.
    headline = "" if cuda else "CUDA not measured (no GPU): CPU figures only, in docs/benchmarks.md"
    bench_run.record(results, table, notes=notes, out=args.out, headline=headline)
    print(
        json.dumps(
            {k: results[k] for k in ("floors", "save", "restore", "dcp", "cuda", "s3") if k in results}, indent=1
        )
    )
    if not cuda:
        print("CUDA figures not measured: torch.cuda.is_available() is False (CPU figures only)")


if __name__ == "__main__":
    main()
