"""Save stall, durable throughput and restore: DCS against the machine's limits and the usual alternatives.

One run, same state (~`--size-mb` MiB of fp32 in `--tensors` tensors), same directory:
  limits   memcpy into a pre-allocated (resident) buffer; sequential write + fsync of the same bytes with 1
           and 4 writers; sequential read of them (page cache dropped with fadvise) with 1 and 4 readers
  (every load/read/restore figure is the median of `--repeats` runs, page cache evicted before each)
  others   torch.save / torch.load; torch.distributed.checkpoint async_save default (thread executor,
           default stager) and its best staging (process executor + shared-memory stager); dcp.load
  ours     Checkpointer.save stall (median of `--repeats` after a warm-up), time to durable commit, and
           restore (verified) through a private redis-server and a real `dcs worker`
Ratios are the figures (docs/benchmarks.md). Writes a result file under bench/results/save/ and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import Row, Run, free_port, start_redis, start_worker, stop
from dcs_tasks import Checkpointer
from dcs_tasks.checkpoint.save.copier import HostCopier
from dcs_tasks.config import DCSConfig

GiB = 1 << 30
MiB = 1 << 20


def make_state(size_mb: int, tensors: int) -> dict[str, torch.Tensor]:
    per = size_mb * MiB // 4 // tensors
    return {f"layers.{i}.weight": torch.randn(per) for i in range(tensors)}


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def drop_cache(root: Path) -> None:
    """Evict the files under `root` from the page cache, so reads hit the disk."""
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def timed(fn: Callable[[], Any]) -> float:
    """Seconds `fn` takes; its result is freed after the clock stops (for every contender alike)."""
    start = time.perf_counter()
    result = fn()
    elapsed = time.perf_counter() - start
    del result
    return elapsed


def cold_median(fn: Callable[[], Any], root: Path, repeats: int) -> float:
    """Median time of `fn` with `root`'s files evicted from the page cache before each run."""
    times = []
    for _ in range(repeats):
        drop_cache(root)
        times.append(timed(fn))
    return statistics.median(times)


def median_of(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    return statistics.median(timed(fn) for _ in range(repeats))


# --- limits ---------------------------------------------------------------------------------------
class Memcpy:
    """The copy limit: `state` into a pre-allocated, resident buffer, by torch `copy_` and by threaded memmove
    (the faster of the two is the limit). `once()` is also run right before each of our saves (paired ratio)."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.buf = torch.empty(nbytes(state), dtype=torch.uint8)
        self.buf.zero_()
        self.copier = HostCopier()
        self.views, self.jobs, pos = [], [], 0
        for t in state.values():
            n = t.numel() * t.element_size()
            self.views.append((self.buf[pos : pos + n].view(t.dtype), t))
            self.jobs.append((self.buf.data_ptr() + pos, t.data_ptr(), n))
            pos += n

    def torch_copy(self) -> None:
        for dst, src in self.views:
            dst.copy_(src)

    def once(self) -> float:
        return timed(lambda: self.copier.copy(self.jobs))

    def limits(self, repeats: int) -> dict[str, float]:
        return {
            "memcpy_torch_s": median_of(self.torch_copy, repeats),
            "memcpy_memmove_s": median_of(lambda: self.copier.copy(self.jobs), repeats),
        }


def _write_part(path: Path, data: memoryview, direct: bool = False) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0), 0o644)
    try:
        for pos in range(0, len(data), 16 * MiB):
            os.write(fd, data[pos : pos + 16 * MiB])
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_part(path: Path) -> None:
    buf = bytearray(16 * MiB)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def _read_direct(path: Path, into: memoryview) -> None:
    """O_DIRECT read of `path` into resident, page-aligned memory, 32 MiB per call."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        for pos in range(0, len(into), 32 * MiB):
            os.preadv(fd, [into[pos : pos + 32 * MiB]], pos)
    finally:
        os.close(fd)


def io_limits(total: int, root: Path, repeats: int) -> dict[str, float]:
    backing = mmap.mmap(-1, total // MiB * MiB)  # page-aligned, so O_DIRECT can use it too
    backing.write(os.urandom(MiB) * (total // MiB))
    data = memoryview(backing)
    out: dict[str, float] = {}
    direct = root / "limit-direct"
    out["write_direct_1_s"] = median_of(lambda: _write_part(direct, data, direct=True), repeats, warmup=0)
    direct.unlink()
    for writers in (1, 4):
        directory = root / f"limit-{writers}"
        directory.mkdir()
        part = len(data) // writers
        paths = [directory / f"part{i}" for i in range(writers)]

        chunks = [(paths[i], data[i * part : (i + 1) * part]) for i in range(writers)]

        def write(chunks: list[tuple[Path, memoryview]] = chunks, writers: int = writers) -> None:
            with ThreadPoolExecutor(writers) as pool:
                list(pool.map(lambda c: _write_part(*c), chunks))

        out[f"write_fsync_{writers}_s"] = median_of(write, repeats, warmup=0)

        def read(paths: list[Path] = paths, directory: Path = directory, writers: int = writers) -> None:
            with ThreadPoolExecutor(writers) as pool:
                list(pool.map(_read_part, paths))

        out[f"read_{writers}_s"] = cold_median(read, directory, repeats)
        if writers == 4:
            out["read_direct_4_s"] = cold_median(partial(_direct_reads, paths, data), directory, repeats)
        shutil.rmtree(directory)
    return out


def _direct_reads(paths: list[Path], backing: memoryview) -> None:
    """O_DIRECT reads of `paths` (one thread each) into the resident `backing` (one part each)."""
    part = len(backing) // len(paths) // MiB * MiB
    with ThreadPoolExecutor(len(paths)) as pool:
        list(pool.map(lambda i: _read_direct(paths[i], backing[i * part : (i + 1) * part]), range(len(paths))))


# --- torch.save / DCP -------------------------------------------------------------------------------
def torch_save(state: dict[str, torch.Tensor], root: Path, repeats: int) -> dict[str, float]:
    path = root / "torch.pt"
    stall = median_of(lambda: torch.save(state, path), repeats)
    load = cold_median(lambda: torch.load(path, weights_only=True), root, repeats)
    path.unlink()
    return {"stall_s": stall, "load_s": load}


def init_dist() -> None:
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1)


def dcp_async(state: dict[str, torch.Tensor], root: Path, repeats: int, best: bool) -> dict[str, float]:
    """Stall = until async_save returns with the state staged; upload = until its future completes."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    kwargs: dict[str, Any] = {}
    if best:
        kwargs["async_checkpointer_type"] = AsyncCheckpointerType.PROCESS
        kwargs["async_stager"] = DefaultStager(StagingOptions(False, True, False, False))
    stalls, uploads = [], []
    for i in range(repeats + 1):
        target = root / f"dcp-{'best' if best else 'default'}-{i}"
        start = time.perf_counter()
        result = dcp.async_save(state, checkpoint_id=str(target), **kwargs)
        staged = time.perf_counter()
        future: Any = getattr(result, "upload_completion", result)
        future.result()
        done = time.perf_counter()
        if i:  # the first call is the warm-up
            stalls.append(staged - start)
            uploads.append(done - start)
        if i < repeats:
            shutil.rmtree(target)
    template = {k: torch.zeros_like(v) for k, v in state.items()}  # resident, like `into=` below
    load = cold_median(lambda: dcp.load(template, checkpoint_id=str(target)), target, repeats)
    shutil.rmtree(target)
    if "async_stager" in kwargs:
        kwargs["async_stager"].close()
    return {"stall_s": statistics.median(stalls), "durable_s": statistics.median(uploads), "load_s": load}


# --- ours -------------------------------------------------------------------------------------------
def ours(state: dict[str, torch.Tensor], root: Path, repeats: int, workers: int, memcpy: Memcpy) -> dict[str, float]:
    (root / "redis").mkdir(parents=True, exist_ok=True)
    redis, redis_url = start_redis(root / "redis")
    config = DCSConfig(
        redis_url=redis_url,
        node_name="benchhost",
        checkpoint_dir=root / "ours",
        staging_dir=Path(tempfile.mkdtemp(prefix="dcs-bench-", dir="/dev/shm")),
        enable_metrics=False,
    )
    worker = start_worker(config, root / "worker.log", concurrency=workers)
    try:
        with Checkpointer("bench", config, size_hint_bytes=nbytes(state) + 64 * MiB) as ckpt:
            stalls, durable, paired = [], [], []
            for step in range(repeats + 1):
                if step:  # every byte changes between saves, as in training (incremental saves find nothing to reuse)
                    with torch.no_grad():
                        for t in state.values():
                            t.add_(1.0)
                limit = memcpy.once()
                start = time.perf_counter()
                pending = ckpt.save(state, step=step)
                pending.wait(timeout=600)
                if step:  # step 0 is the warm-up
                    stalls.append(pending.stall_seconds)
                    durable.append(time.perf_counter() - start)
                    paired.append(pending.stall_seconds / limit)
            restore = cold_median(lambda: ckpt.restore(step=repeats), config.checkpoint.dir, repeats)
            into = {k: torch.zeros_like(v) for k, v in state.items()}  # resident, like dcp.load's template
            restore_into = cold_median(lambda: ckpt.restore(step=repeats, into=into), config.checkpoint.dir, repeats)
            assert all(torch.equal(into[k], state[k]) for k in state)  # the last save's bytes
    finally:
        stop(worker)
        stop(redis)
        shutil.rmtree(config.host.staging_dir, ignore_errors=True)
    return {
        "stall_s": statistics.median(stalls),
        "stall_vs_memcpy_paired": statistics.median(paired),
        "durable_s": statistics.median(durable),
        "staged_to_committed_s": statistics.median(d - s for d, s in zip(durable, stalls, strict=True)),
        "restore_s": restore,
        "restore_into_s": restore_into,
    }


def summarize(total: int, r: dict[str, Any]) -> dict[str, float]:
    gb = total / 1e9
    best_write = min(r["limits"]["write_fsync_1_s"], r["limits"]["write_fsync_4_s"])
    best_read = min(r["limits"]["read_1_s"], r["limits"]["read_4_s"])
    dcp_best_stall = min(r["dcp_default"]["stall_s"], r["dcp_best"]["stall_s"])
    return {
        "stall_vs_memcpy": r["ours"]["stall_s"] / r["limits"]["memcpy_s"],
        "stall_vs_memcpy_paired": r["ours"]["stall_vs_memcpy_paired"],
        "stall_vs_dcp_best": r["ours"]["stall_s"] / dcp_best_stall,
        "durable_GBps": gb / r["ours"]["staged_to_committed_s"],
        "durable_vs_best_parallel_write": best_write / r["ours"]["staged_to_committed_s"],
        "durable_vs_best_write_incl_odirect": min(best_write, r["limits"]["write_direct_1_s"])
        / r["ours"]["staged_to_committed_s"],
        "restore_vs_read_limit": best_read / r["ours"]["restore_s"],
        "restore_vs_read_limit_incl_odirect": min(best_read, r["limits"]["read_direct_4_s"]) / r["ours"]["restore_s"],
        "restore_vs_dcp_load": r["dcp_default"]["load_s"] / r["ours"]["restore_s"],
        "restore_vs_torch_load": r["torch_save"]["load_s"] / r["ours"]["restore_s"],
        "restore_into_vs_read_limit": best_read / r["ours"]["restore_into_s"],
        "restore_into_vs_dcp_load": r["dcp_default"]["load_s"] / r["ours"]["restore_into_s"],
    }


def rows(r: dict[str, Any]) -> list[Row]:
    """docs/benchmarks.md's rows: stall, durable commit, restore and restore `into=` against their limits."""
    q, ours = r["ratios"], r["ours"]
    best_write = min(r["limits"]["write_fsync_1_s"], r["limits"]["write_fsync_4_s"], r["limits"]["write_direct_1_s"])
    best_read = min(r["limits"]["read_1_s"], r["limits"]["read_4_s"])  # buffered, 1 and 4 readers
    gib = f"{r['bytes'] / 2**30:.3g} GiB in {r['tensors']} tensors"
    restore_met = q["restore_vs_read_limit"] >= 0.9 and q["restore_vs_dcp_load"] >= 1.2
    into_met = q["restore_into_vs_read_limit"] >= 0.9 and q["restore_into_vs_dcp_load"] >= 1.2
    return [
        Row(
            what=f"save stall, {gib}",
            ours=f"{ours['stall_s'] * 1e3:.0f} ms",
            compared=f"memcpy into a resident buffer {r['limits']['memcpy_s'] * 1e3:.0f} ms; DCP async_save "
            f"{r['dcp_default']['stall_s'] * 1e3:.0f} / {r['dcp_best']['stall_s'] * 1e3:.0f} ms (default / best)",
            ratio=q["stall_vs_memcpy"],
            ratio_text=f"{q['stall_vs_memcpy']:.2f}x memcpy ({q['stall_vs_memcpy_paired']:.2f}x paired); "
            f"{q['stall_vs_dcp_best']:.2f}x DCP's best",
            target="<= 1.1x memcpy and <= DCP's best",
            met=q["stall_vs_memcpy"] <= 1.1 and q["stall_vs_dcp_best"] <= 1.0,
        ),
        Row(
            what="staged -> durable commit (fsync on)",
            ours=f"{ours['staged_to_committed_s']:.2f} s",
            compared=f"best sequential write + fsync (1, 4 writers, O_DIRECT) {best_write:.2f} s",
            ratio=q["durable_vs_best_write_incl_odirect"],
            ratio_text=f"{q['durable_vs_best_write_incl_odirect']:.2f}x the best write",
            target=">= 1.0x the best write",
            met=q["durable_vs_best_write_incl_odirect"] >= 1.0,
        ),
        Row(
            what="restore, verified, page cache dropped, into new memory",
            ours=f"{ours['restore_s']:.2f} s",
            compared=f"sequential read {best_read:.2f} s; dcp.load {r['dcp_default']['load_s']:.2f} s; "
            f"torch.load {r['torch_save']['load_s']:.2f} s",
            ratio=q["restore_vs_read_limit"],
            ratio_text=f"{q['restore_vs_read_limit']:.2f}x the read limit; "
            f"{q['restore_vs_dcp_load']:.2f}x faster than DCP",
            target=">= 0.9x read, >= 1.2x DCP",
            met=restore_met,
        ),
        Row(
            what="restore into= existing tensors",
            ours=f"{ours['restore_into_s']:.2f} s",
            compared="the same limits; dcp.load into a template",
            ratio=q["restore_into_vs_read_limit"],
            ratio_text=f"{q['restore_into_vs_read_limit']:.2f}x the read limit; "
            f"{q['restore_into_vs_dcp_load']:.2f}x faster than DCP",
            target=">= 0.9x read, >= 1.2x DCP",
            met=into_met,
        ),
    ]


def main() -> None:
    bench_run = Run("save")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--tensors", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=4, help="`dcs worker` processes (files written in parallel)")
    parser.add_argument("--dir", type=Path, default=None, help="where files are written (default: a temp dir)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="dcs-bench-save-", dir=args.dir))
    state = make_state(args.size_mb, args.tensors)
    total = nbytes(state)
    results: dict[str, Any] = {"bytes": total, "tensors": len(state), "repeats": args.repeats}
    try:
        memcpy = Memcpy(state)
        copies = memcpy.limits(args.repeats)
        results["limits"] = {"memcpy_s": min(copies.values()), **copies, **io_limits(total, root, args.repeats)}
        results["torch_save"] = torch_save(state, root, args.repeats)
        init_dist()
        results["dcp_default"] = dcp_async(state, root, args.repeats, best=False)
        results["dcp_best"] = dcp_async(state, root, args.repeats, best=True)
        results["ours"] = ours(state, root, args.repeats, args.workers, memcpy)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    results["ratios"] = summarize(total, results)
    bench_run.record(results, rows(results))
    report(results)


def report(r: dict[str, Any]) -> None:
    lim, ours_r, rat = r["limits"], r["ours"], r["ratios"]
    print(json.dumps({k: r[k] for k in ("limits", "torch_save", "dcp_default", "dcp_best", "ours")}, indent=1))
    dcp_d, dcp_b = r["dcp_default"]["stall_s"] * 1e3, r["dcp_best"]["stall_s"] * 1e3
    print(
        f"save {r['bytes'] / GiB:.2f} GiB/{r['tensors']} tensors: stall {ours_r['stall_s'] * 1e3:.0f} ms = "
        f"{rat['stall_vs_memcpy']:.2f}x memcpy ({lim['memcpy_s'] * 1e3:.0f} ms; paired "
        f"{rat['stall_vs_memcpy_paired']:.2f}x), {rat['stall_vs_dcp_best']:.2f}x "
        f"DCP best (default {dcp_d:.0f} ms, best {dcp_b:.0f} ms), torch.save "
        f"{r['torch_save']['stall_s'] * 1e3:.0f} ms | staged->committed {ours_r['staged_to_committed_s']:.2f} s = "
        f"{rat['durable_vs_best_parallel_write']:.2f}x best fsync write "
        f"({rat['durable_vs_best_write_incl_odirect']:.2f}x incl. O_DIRECT)"
    )
    print(
        f"restore (verified, cache dropped) into new memory {ours_r['restore_s']:.2f} s = "
        f"{rat['restore_vs_read_limit']:.2f}x read limit ({min(lim['read_1_s'], lim['read_4_s']):.2f} s; "
        f"{rat['restore_vs_read_limit_incl_odirect']:.2f}x incl. O_DIRECT {lim['read_direct_4_s']:.2f} s), "
        f"{rat['restore_vs_dcp_load']:.2f}x DCP load ({r['dcp_default']['load_s']:.2f} s), "
        f"{rat['restore_vs_torch_load']:.2f}x torch.load ({r['torch_save']['load_s']:.2f} s) | into existing "
        f"tensors {ours_r['restore_into_s']:.2f} s = {rat['restore_into_vs_read_limit']:.2f}x read limit, "
        f"{rat['restore_into_vs_dcp_load']:.2f}x DCP load (ratios > 1: faster)"
    )


if __name__ == "__main__":
    main()
