"""Resharding restore: a DTensor state saved by 4 ranks, restored by 2 and by 8, DCS against torch DCP.

One run, same state, same disk: a gloo group of `--save-world` processes builds FSDP-style DTensors
(`--tensors` weights of ~`--size-mb` MiB in all, `Shard(0)` with uneven rows, plus one replicated tensor)
and saves them with `Checkpointer.save` (through a private redis-server and a real `dcs worker`, timed to the
durable commit) and with `torch.distributed.checkpoint.save`. Then, for each `--restore-world`, a new group
restores into zeroed DTensors on its own mesh with `Checkpointer.restore(into=)` (verified) and with
`dcp.load`, the page cache of both checkpoints evicted before each, and checks every local shard bit for bit
against `distribute_tensor` of the full tensor. Per restore: wall time (slowest rank), and bytes read summed
over ranks: /proc/self/io `read_bytes` (from the disk), `rchar` (every read syscall, sockets included) and,
for DCS, its own count of checkpoint data bytes read. Writes a result file under bench/results/reshard/ and
prints a summary.

    .venv/bin/python bench/reshard.py --size-mb 256
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import REPO, Run, free_port, start_redis, start_worker, stop
from dcs_tasks.config import DCSConfig

MiB = 1 << 20
COLS = 1024


def full(index: int, rows: int) -> torch.Tensor:
    return torch.randn(rows, COLS, generator=torch.Generator().manual_seed(index))


def rows_of(size_mb: int, tensors: int) -> int:
    return size_mb * MiB // 4 // COLS // tensors + 3  # + 3: shards are uneven at every world size tried


def io_counters() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/io").read_text().splitlines():
        key, value = line.split(":")
        out[key] = int(value)
    return out


def evict(root: Path) -> None:
    """Drop `root`'s files from the page cache, so the next read comes from the disk."""
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


# --- one rank of a group ---------------------------------------------------------------------------------


def _state(job: dict[str, Any], mesh: Any, zero: bool) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    rows = rows_of(job["size_mb"], job["tensors"])
    model: dict[str, Any] = {}
    for i in range(job["tensors"]):
        tensor = torch.zeros(rows, COLS) if zero else full(i, rows)
        model[f"layers.{i}.weight"] = distribute_tensor(tensor, mesh, [Shard(0)])
    norm = torch.zeros(4096) if zero else torch.arange(4096, dtype=torch.float32)
    model["norm.weight"] = distribute_tensor(norm, mesh, [Replicate()])
    return {"model": model}


def _timed(fn: Any) -> tuple[float, dict[str, int]]:
    import torch.distributed as dist

    dist.barrier()
    before, started = io_counters(), time.perf_counter()
    fn()
    seconds = time.perf_counter() - started
    after = io_counters()
    dist.barrier()
    return seconds, {k: after[k] - before[k] for k in ("read_bytes", "rchar")}


def _save(job: dict[str, Any], rank: int, mesh: Any) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    from dcs_tasks import Checkpointer

    state = _state(job, mesh, zero=False)
    with Checkpointer("reshard", DCSConfig(), rank=rank, world_size=job["world"]) as ckpt:
        dcs_s, _ = _timed(lambda: ckpt.save(state, 1).wait(timeout=600))
    dcp_s, _ = _timed(lambda: dcp.save(state, checkpoint_id=job["dcp_dir"]))
    return {"dcs_save_s": dcs_s, "dcp_save_s": dcp_s}


def _matches(job: dict[str, Any], mesh: Any, state: dict[str, Any]) -> bool:
    expected = _state(job, mesh, zero=False)["model"]
    return all(
        torch.equal(t.to_local().view(torch.uint8), expected[n].to_local().view(torch.uint8))
        for n, t in state["model"].items()
    )


def _restore(job: dict[str, Any], rank: int, mesh: Any) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from dcs_tasks import Checkpointer
    from dcs_tasks.checkpoint.restore import boxread

    out: dict[str, Any] = {}
    target = _state(job, mesh, zero=True)
    with Checkpointer("reshard", DCSConfig(), rank=rank, world_size=job["world"]) as ckpt:
        if rank == 0:
            evict(Path(job["dcs_dir"]))
        counted = boxread.bytes_read_total()
        out["dcs_s"], out["dcs_io"] = _timed(lambda: ckpt.restore(into=target))
        out["dcs_counted"] = boxread.bytes_read_total() - counted
    out["dcs_ok"] = _matches(job, mesh, target)
    target = _state(job, mesh, zero=True)
    if rank == 0:
        evict(Path(job["dcp_dir"]))
    dist.barrier()
    out["dcp_s"], out["dcp_io"] = _timed(lambda: dcp.load(target, checkpoint_id=job["dcp_dir"]))
    out["dcp_ok"] = _matches(job, mesh, target)
    out["local_bytes"] = sum(t.to_local().numel() * t.element_size() for t in target["model"].values())
    return out


def node(job_path: str, rank_text: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    job = json.loads(Path(job_path).read_text())
    rank = int(rank_text)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{job['port']}", rank=rank, world_size=job["world"])
    mesh = init_device_mesh("cpu", (job["world"],))
    result = _save(job, rank, mesh) if job["action"] == "save" else _restore(job, rank, mesh)
    Path(job["out"]).joinpath(f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


# --- driver ----------------------------------------------------------------------------------------------


def run_group(config: DCSConfig, work: Path, tag: str, world: int, job: dict[str, Any]) -> list[dict[str, Any]]:
    out = work / tag
    out.mkdir()
    job = {**job, "world": world, "port": free_port(), "out": str(out)}
    job_path = work / f"{tag}.json"
    job_path.write_text(json.dumps(job))
    env = {k: v for k, v in os.environ.items() if not k.startswith("DCS_")}
    env.update(config.to_env())
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    procs = [
        subprocess.Popen([sys.executable, __file__, "--node", str(job_path), str(r)], env=env, cwd=REPO)
        for r in range(world)
    ]
    codes = [p.wait(timeout=1800) for p in procs]
    if any(codes):
        raise RuntimeError(f"group {tag} failed: exit codes {codes}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def summarize(reports: list[dict[str, Any]]) -> dict[str, Any]:
    total = {k: sum(r[k] for r in reports) for k in ("dcs_counted", "local_bytes")}
    return {
        "ranks": len(reports),
        "bit_exact": all(r["dcs_ok"] and r["dcp_ok"] for r in reports),
        "needed_bytes": total["local_bytes"],
        "dcs": {
            "seconds": max(r["dcs_s"] for r in reports),
            "read_bytes": sum(r["dcs_io"]["read_bytes"] for r in reports),
            "rchar": sum(r["dcs_io"]["rchar"] for r in reports),
            "counted": total["dcs_counted"],
        },
        "dcp": {
            "seconds": max(r["dcp_s"] for r in reports),
            "read_bytes": sum(r["dcp_io"]["read_bytes"] for r in reports),
            "rchar": sum(r["dcp_io"]["rchar"] for r in reports),
        },
    }


def main() -> None:
    bench_run = Run("reshard")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=256)
    parser.add_argument("--tensors", type=int, default=8)
    parser.add_argument("--save-world", type=int, default=4)
    parser.add_argument("--restore-world", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--dir", type=Path, default=None, help="where checkpoints go (default: a temp dir on disk)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="dcs-reshard-", dir=args.dir))
    redis, url = start_redis(work)
    config = DCSConfig(
        redis_url=url, checkpoint_dir=work / "dcs", staging_dir=Path("/dev/shm") / work.name, enable_metrics=False
    )
    worker = start_worker(config, work / "worker.log", concurrency=2)
    try:
        job = {
            "size_mb": args.size_mb,
            "tensors": args.tensors,
            "dcs_dir": str(work / "dcs"),
            "dcp_dir": str(work / "dcp"),
        }
        saved = run_group(config, work, "save", args.save_world, {**job, "action": "save"})
        result: dict[str, Any] = {
            "state_mb": args.size_mb,
            "save_world": args.save_world,
            "dcs_save_s": max(r["dcs_save_s"] for r in saved),
            "dcp_save_s": max(r["dcp_save_s"] for r in saved),
            "restore": {},
        }
        for world in args.restore_world:
            reports = run_group(config, work, f"restore{world}", world, {**job, "action": "restore"})
            result["restore"][str(world)] = summarize(reports)
    finally:
        stop(worker)
        stop(redis)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(Path("/dev/shm") / work.name, ignore_errors=True)
    bench_run.record(result)
    print(f"state {args.size_mb} MiB saved by {args.save_world} ranks: DCS {result['dcs_save_s']:.2f}s to commit, "
          f"DCP {result['dcp_save_s']:.2f}s")  # fmt: skip
    for world, s in result["restore"].items():
        print(f"restore at {world} ranks (bit-exact: {s['bit_exact']}, needed {s['needed_bytes'] / MiB:.1f} MiB):")
        for who in ("dcs", "dcp"):
            f = s[who]
            counted = f"  counted {f['counted'] / MiB:.1f} MiB" if "counted" in f else ""
            print(f"  {who}: {f['seconds']:.2f}s  disk read {f['read_bytes'] / MiB:.1f} MiB  "
                  f"rchar {f['rchar'] / MiB:.1f} MiB{counted}")  # fmt: skip


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--node":
        node(sys.argv[2], sys.argv[3])
    else:
        main()
