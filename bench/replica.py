"""Replication throughput: the replicate task against a plain copy of the same files.

One committed step of ~`--size-mb` MiB of fp32 (files of `file_shard_bytes`, 256 MiB by default), saved through a
private redis-server and a real `dcs worker` with `replica_dir` set, then:
  task      the `dcs.ckpt.replicate` task's own time per step (its Celery result: check the primary, copy with
            the hash on the same pass, fsync + rename, read the replica back and verify it, manifest, `latest`),
            medians over `--repeats` saved steps (the copy then competes with the primary's retention)
  copy_step the same copy + verify in this process (`dcs_tasks.checkpoint.replicating.copy_step`), page cache
            of the primary evicted first, into a fresh directory each time
  plain     `shutil.copyfile` of the same files + fsync + directory fsync (cold primary), and the same plus a
            read-back of the copy with the page cache evicted (what "copy and check" costs without DCS)
The three in-process contenders take turns, `--repeats` rounds. GB/s = step bytes / seconds (1 GB = 1e9
bytes). Writes a result file under bench/results/replica/ and prints a summary.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import Run, start_redis, start_worker, stop
from bench.save import drop_cache, make_state, nbytes
from dcs_tasks import Checkpointer
from dcs_tasks.celery_app import make_celery
from dcs_tasks.checkpoint.replicating import copy_step
from dcs_tasks.checkpoint.restore.reader import load_manifest
from dcs_tasks.checkpoint.store.ledger.stepledger import StepLedger
from dcs_tasks.checkpoint.store.writes.durable import fsync_dir
from dcs_tasks.config import DCSConfig
from dcs_tasks.keys import Keys
from dcs_tasks.redisconn import sync_client
from workers.ckpt_tasks import replica_task_id

MiB = 1 << 20


def through_worker(state: dict[str, torch.Tensor], root: Path, repeats: int) -> tuple[list[float], Path]:
    """Save `repeats` steps; the replicate task's seconds for each (its Celery result); the last primary step."""
    (root / "redis").mkdir(parents=True, exist_ok=True)
    redis, redis_url = start_redis(root / "redis")
    config = DCSConfig(
        redis_url=redis_url,
        node_name="benchhost",
        checkpoint_dir=root / "primary",
        replica_dir=root / "replica",
        staging_dir=Path(tempfile.mkdtemp(prefix="dcs-bench-", dir="/dev/shm")),
        enable_metrics=False,
        keep_last=2,
    )
    worker = start_worker(config, root / "worker.log", concurrency=2)
    app = make_celery(config)
    ledger = StepLedger(sync_client(config), Keys(config.redis.namespace))
    seconds = []
    try:
        with Checkpointer("bench", config, size_hint_bytes=nbytes(state) + 64 * MiB) as ckpt:
            for step in range(repeats):
                info = ckpt.save(state, step=step).wait(timeout=600)
                result = app.AsyncResult(replica_task_id(ledger.read("bench", step).token)).get(timeout=600)
                assert result["copied_bytes"] >= info.nbytes, result
                seconds.append(float(result["seconds"]))
    finally:
        app.close()
        stop(worker)
        stop(redis)
        shutil.rmtree(config.host.staging_dir, ignore_errors=True)
    return seconds, Path(info.path)


def plain_copy(src: Path, dst: Path, read_back: bool) -> None:
    dst.mkdir(parents=True)
    for path in sorted(src.iterdir()):
        target = dst / path.name
        shutil.copyfile(path, target)
        fd = os.open(target, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fsync_dir(dst)
    if read_back:
        drop_cache(dst)
        for path in sorted(dst.iterdir()):
            with open(path, "rb", buffering=0) as f:
                while f.read(32 * MiB):
                    pass


def alternating(contenders: dict[str, Any], src: Path, scratch: Path, repeats: int) -> dict[str, float]:
    """Median seconds of each `fn(src, fresh_dir)`, contenders taking turns (so a busy spell of a shared
    machine hits each alike), `src` evicted from the page cache before every run."""
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for i in range(repeats):
        for name, fn in contenders.items():
            dst = scratch / f"{name}-{i}" / src.name
            drop_cache(src)
            started = time.perf_counter()
            fn(src, dst)
            times[name].append(time.perf_counter() - started)
            shutil.rmtree(dst.parent)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    bench_run = Run("replica")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="scratch directory on the disk to measure")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="dcs-bench-replica-", dir=args.dir))
    try:
        state = make_state(args.size_mb, args.tensors)
        total = nbytes(state)
        task, step_dir = through_worker(state, root, args.repeats)
        manifest = load_manifest(step_dir)
        size = manifest.total_bytes
        contenders = {
            "copy_step_s": lambda s, d: copy_step(s, d, manifest, "bench"),
            "plain_copy_s": lambda s, d: plain_copy(s, d, False),
            "plain_copy_read_back_s": lambda s, d: plain_copy(s, d, True),
        }
        figures = {
            "step_bytes": size,
            "task_s": statistics.median(task),
            **alternating(contenders, step_dir, root / "scratch", args.repeats),
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rates = {k.removesuffix("_s") + "_gb_per_s": size / 1e9 / v for k, v in figures.items() if k.endswith("_s")}
    results = {"size_mb": args.size_mb, "tensor_bytes": total, "files": len(manifest.files), **figures, **rates}
    bench_run.record(results)
    for key, rate in rates.items():
        seconds = figures[key.removesuffix("_gb_per_s") + "_s"]
        print(f"{key.removesuffix('_gb_per_s'):<24} {seconds:7.3f} s  {rate:6.2f} GB/s")
    print(
        f"ratios: task / plain copy {rates['task_gb_per_s'] / rates['plain_copy_gb_per_s']:.2f}x, "
        f"copy_step / plain copy + read-back "
        f"{rates['copy_step_gb_per_s'] / rates['plain_copy_read_back_gb_per_s']:.2f}x"
    )


if __name__ == "__main__":
    main()
