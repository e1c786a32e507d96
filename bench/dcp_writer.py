"""torch DCP's `async_save` to files: DCP's own `FileSystemWriter` against DCS's `DCSStorageWriter`, same state.

One process (no process group), one model-like state (fp32 and bf16 tensors, an optimizer-like set of fp32
moments, a few plain values). Each round saves the same state once with each writer, in alternating order, on
one real `dcs worker` and redis-server: `FileSystemWriter(<dir>/fs/step-N)` (DCP's files, fsynced) and
`DCSStorageWriter(checkpointer, step=N)` (a committed DCS step under <dir>/dcs). Per save: the stall (how long
`dcp.async_save` blocks the caller: for FileSystemWriter DCP's default stager copying the state to CPU memory; for
DCSStorageWriter, which is DCP's AsyncStager, DCS's copy into its reused shared-memory staging buffers) and
the time to durable (until the future `async_save` returned completes: every file written and, for DCS, the
step committed). The floor: one libc memcpy of each of the state's tensors into preallocated, already-touched
memory, timed each round. Figures are medians over the rounds after the first (warm-up).

    .venv/bin/python bench/dcp_writer.py [--size-mb 512] [--rounds 5] [--workers 2] [--dir /path]
"""

from __future__ import annotations

import argparse
import ctypes
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/dcp_writer.py` from the root

from bench.harness import Row, Run, start_redis, start_worker, stop
from dcs_tasks import Checkpointer
from dcs_tasks.config import DCSConfig
from dcs_tasks.integrations.dcp import DCSStorageWriter

MiB = 1 << 20
_memcpy = ctypes.CDLL(None).memcpy
_memcpy.restype = ctypes.c_void_p
_memcpy.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
WARMUP = 1


def model_state(size_mb: int, layers: int = 16) -> dict[str, Any]:
    """Per layer a bf16 weight and its fp32 moments (2x), sized to `size_mb` in all, plus plain values."""
    per_layer = size_mb * MiB // layers
    elems = per_layer // (2 + 8)  # bf16 weight + two fp32 moments
    model = {f"layers.{i}.weight": torch.randn(elems).to(torch.bfloat16) for i in range(layers)}
    optim = {name: {"exp_avg": torch.randn(elems), "exp_avg_sq": torch.rand(elems), "step": 10} for name in model}
    return {"model": model, "optim": optim, "trainer": {"epoch": 1, "lr": 3e-4}}


def nbytes(state: dict[str, Any]) -> int:
    total = 0
    for value in state.values():
        for item in value.values():
            if isinstance(item, torch.Tensor):
                total += item.numel() * item.element_size()
            elif isinstance(item, dict):
                total += sum(t.numel() * t.element_size() for t in item.values() if isinstance(t, torch.Tensor))
    return total


def timed(state: dict[str, Any], writer: Any) -> tuple[float, float]:
    """(stall, time to durable) of one `dcp.async_save`."""
    started = time.perf_counter()
    future = dcp.async_save(state, storage_writer=writer)
    stall = time.perf_counter() - started
    future.result(timeout=900)
    return stall, time.perf_counter() - started


def memcpy_seconds(state: dict[str, Any], into: list[torch.Tensor]) -> float:
    """One libc `memcpy` of every tensor of `state` into `into` (preallocated, touched): the floor of any stall."""
    sources = [t for part in ("model", "optim") for t in _tensors(state[part])]
    started = time.perf_counter()
    for dst, src in zip(into, sources, strict=True):
        _memcpy(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size())
    return time.perf_counter() - started


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def run(args: argparse.Namespace, root: Path) -> dict[str, list[dict[str, float]]]:
    (root / "redis").mkdir(parents=True)
    redis, redis_url = start_redis(root / "redis")
    staging = Path(tempfile.mkdtemp(prefix="dcs-bench-dcp-", dir="/dev/shm"))
    config = DCSConfig(redis_url=redis_url, node_name="benchhost", checkpoint_dir=root / "dcs",
                       staging_dir=staging, enable_metrics=False, file_shard_bytes=args.shard_mb * MiB)  # fmt: skip
    worker = start_worker(config, root / "worker.log", concurrency=args.workers)
    state = model_state(args.size_mb)
    rows: dict[str, list[dict[str, float]]] = {"fs": [], "dcs": [], "memcpy": []}
    into = [torch.zeros_like(t) for part in ("model", "optim") for t in _tensors(state[part])]
    try:
        with Checkpointer("dcp-bench", config, size_hint_bytes=nbytes(state) + 64 * MiB) as ckpt:
            for step in range(1, args.rounds + 1):
                order = ["fs", "dcs"] if step % 2 else ["dcs", "fs"]
                for mode in order:
                    if mode == "fs":
                        writer: Any = FileSystemWriter(str(root / "fs" / f"step-{step}"), thread_count=args.workers)
                    else:
                        writer = DCSStorageWriter(ckpt, step=step)
                    stall, durable = timed(state, writer)
                    rows[mode].append({"step": step, "stall_s": stall, "durable_s": durable})
                copied = memcpy_seconds(state, into)
                rows["memcpy"].append({"step": step, "stall_s": copied, "durable_s": copied})
                shutil.rmtree(root / "fs" / f"step-{step}", ignore_errors=True)  # keep the disk from filling
    finally:
        stop(worker)
        stop(redis)
        shutil.rmtree(staging, ignore_errors=True)
    return rows


def summarize(rows: dict[str, list[dict[str, float]]]) -> dict[str, float]:
    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in rows[mode][WARMUP:])

    return {
        "stall_fs_s": med("fs", "stall_s"),
        "stall_dcs_s": med("dcs", "stall_s"),
        "durable_fs_s": med("fs", "durable_s"),
        "durable_dcs_s": med("dcs", "durable_s"),
        "durable_speedup": med("fs", "durable_s") / med("dcs", "durable_s"),
        "stall_ratio": med("dcs", "stall_s") / med("fs", "stall_s"),
        "memcpy_s": med("memcpy", "stall_s"),
        "stall_vs_memcpy": med("dcs", "stall_s") / med("memcpy", "stall_s"),
    }


def main() -> None:
    bench_run = Run("dcp_writer")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5, help="saves per writer (the first is the warm-up)")
    parser.add_argument("--shard-mb", type=int, default=64, help="DCS_FILE_SHARD_BYTES in MiB")
    parser.add_argument("--workers", type=int, default=2, help="`dcs worker` processes and FileSystemWriter threads")
    parser.add_argument("--dir", type=Path, default=None, help="where files are written (default: a temp dir)")
    args = parser.parse_args()
    if args.rounds <= WARMUP:
        parser.error(f"--rounds must be more than {WARMUP}")
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    root = Path(tempfile.mkdtemp(prefix="dcs-bench-dcp-", dir=args.dir))
    try:
        rows = run(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    q = summarize(rows)
    results = {"args": {k: str(v) for k, v in vars(args).items()}, "saves": rows, "summary": q}
    row = Row(
        what=f"dcp.async_save of a {args.size_mb} MiB state: DCSStorageWriter vs DCP's FileSystemWriter",
        ours=f"stall {q['stall_dcs_s'] * 1e3:.0f} ms, durable (committed) {q['durable_dcs_s']:.2f} s",
        compared=(
            f"FileSystemWriter: stall {q['stall_fs_s'] * 1e3:.0f} ms, durable {q['durable_fs_s']:.2f} s; "
            f"plain memcpy {q['memcpy_s'] * 1e3:.0f} ms"
        ),
        ratio=q["durable_speedup"],
        ratio_text=(
            f"durable {q['durable_speedup']:.2f}x as fast; stall {q['stall_ratio']:.2f}x FileSystemWriter's, "
            f"{q['stall_vs_memcpy']:.2f}x a memcpy"
        ),
        target="stall <= 1.1x a memcpy and below FileSystemWriter's, durable no slower",
        met=q["stall_vs_memcpy"] <= 1.1 and q["stall_ratio"] < 1.0 and q["durable_speedup"] >= 0.9,
    )
    bench_run.record(results, [row])
    for mode, mode_rows in rows.items():
        for r in mode_rows:
            print(
                f"{mode:>4} round {r['step']:2d}: stall {r['stall_s'] * 1e3:7.1f} ms, durable {r['durable_s']:6.2f} s"
            )
    for key, value in q.items():
        print(f"{key:>18}: {value:.3f}")


if __name__ == "__main__":
    main()
