"""Incremental saves on a fine-tuning state: bytes written per save and the trainer's stall, incremental vs full.

The state is LoRA-like: per layer a frozen bf16 weight and a small trainable adapter (interleaved, as a model's
`state_dict()` orders them) plus the adapters' AdamW moments (fp32), with `--frozen` of the bytes frozen. Two
runs on one real `dcs worker` and redis-server, saves alternating between them so that both see the same
machine: `full` (DCS_INCREMENTAL_SAVES off) and `incremental` (on). Between saves the adapters and moments are
updated in place (not timed). The first two incremental saves write everything (no earlier step; then the
layout moves the tensors seen changing into files of their own); the figures are the medians of the saves after
those. Written bytes = the manifest's files without `source_step` (and the step directory's size on disk).

    .venv/bin/python bench/incremental.py [--size-mb 1024] [--layers 32] [--frozen 0.9] [--saves 6]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/incremental.py` from the root

from bench.harness import Row, Run, start_redis, start_worker, stop
from dcs_tasks import Checkpointer
from dcs_tasks.checkpoint.restore.reader import load_manifest
from dcs_tasks.config import DCSConfig

MiB = 1 << 20
WARMUP = 2  # saves before the layout is stable (see the docstring)


def finetune_state(size_mb: int, layers: int, frozen: float) -> dict[str, Any]:
    """Per layer: frozen bf16 weight (F bytes), trainable fp32 adapter (P) and two fp32 moments (2P), with
    F / (F + 3P) = `frozen`."""
    per_layer = size_mb * MiB // layers
    frozen_elems = int(per_layer * frozen) // 2
    adapter_elems = max(1, int(per_layer * (1 - frozen)) // 12)
    model: dict[str, torch.Tensor] = {}
    for i in range(layers):
        model[f"layers.{i}.weight"] = torch.randn(frozen_elems).to(torch.bfloat16)
        model[f"layers.{i}.lora"] = torch.randn(adapter_elems)
    trainable = [name for name in model if name.endswith("lora")]
    optim = {name: {"exp_avg": torch.zeros_like(model[name]), "exp_avg_sq": torch.zeros_like(model[name])}
             for name in trainable}  # fmt: skip
    return {"model": model, "optim": optim, "step": 0}


def train(state: dict[str, Any]) -> None:
    for name, moments in state["optim"].items():
        moments["exp_avg"].mul_(0.9).add_(0.1)
        moments["exp_avg_sq"].mul_(0.99).add_(0.01)
        state["model"][name].sub_(moments["exp_avg"] * 1e-3)
    state["step"] += 1


def nbytes(state: dict[str, Any]) -> int:
    model = sum(t.numel() * t.element_size() for t in state["model"].values())
    return model + sum(t.numel() * t.element_size() for m in state["optim"].values() for t in m.values())


def written(step_dir: Path) -> tuple[int, int, int]:
    """(bytes of the step's files, bytes the step wrote itself per its manifest, bytes in its directory)."""
    manifest = load_manifest(step_dir)
    own = sum(f.size for f in manifest.files if f.source_step is None)
    on_disk = sum(p.stat().st_size for p in step_dir.glob("*.safetensors"))
    return manifest.total_bytes, own, on_disk


def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    (root / "redis").mkdir(parents=True)
    redis, redis_url = start_redis(root / "redis")
    staging = Path(tempfile.mkdtemp(prefix="dcs-bench-incr-", dir="/dev/shm"))
    config = DCSConfig(redis_url=redis_url, node_name="benchhost", checkpoint_dir=root / "ckpt",
                       staging_dir=staging, enable_metrics=False, file_shard_bytes=args.shard_mb * MiB)  # fmt: skip
    worker = start_worker(config, root / "worker.log", concurrency=args.workers)
    state = finetune_state(args.size_mb, args.layers, args.frozen)
    modes = {"full": config.model_copy(update={"incremental_saves": False}), "incremental": config}
    rows: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
    try:
        ckpts = {mode: Checkpointer(mode, cfg, size_hint_bytes=nbytes(state) + 64 * MiB) for mode, cfg in modes.items()}
        for step in range(1, args.saves + 1):
            train(state)
            for mode, ckpt in ckpts.items():
                started = time.perf_counter()
                pending = ckpt.save(state, step=step)
                info = pending.wait(timeout=600)
                durable = time.perf_counter() - started
                total, own, on_disk = written(info.path)
                rows[mode].append({"step": step, "stall_s": pending.stall_seconds, "durable_s": durable,
                                   "bytes": total, "written": own, "on_disk": on_disk})  # fmt: skip
        restored = ckpts["incremental"].restore()
        assert restored.step == args.saves and torch.equal(restored.state["model"]["layers.0.lora"],
                                                           state["model"]["layers.0.lora"])  # fmt: skip
        for ckpt in ckpts.values():
            ckpt.close()
    finally:
        stop(worker)
        stop(redis)
        shutil.rmtree(staging, ignore_errors=True)
    return rows


def summarize(rows: dict[str, list[dict[str, float]]]) -> dict[str, float]:
    steady = {mode: r[WARMUP:] for mode, r in rows.items()}

    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in steady[mode])

    return {
        "written_fraction": med("incremental", "written") / med("incremental", "bytes"),
        "on_disk_fraction": med("incremental", "on_disk") / med("incremental", "bytes"),
        "stall_full_s": med("full", "stall_s"),
        "stall_incremental_s": med("incremental", "stall_s"),
        "stall_ratio": med("incremental", "stall_s") / med("full", "stall_s"),
        "durable_full_s": med("full", "durable_s"),
        "durable_incremental_s": med("incremental", "durable_s"),
        "durable_speedup": med("full", "durable_s") / med("incremental", "durable_s"),
    }


def main() -> None:
    bench_run = Run("incremental")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--frozen", type=float, default=0.9, help="fraction of the bytes that never change")
    parser.add_argument("--saves", type=int, default=6, help="saves per mode (the first 2 are the warm-up)")
    parser.add_argument("--shard-mb", type=int, default=64, help="DCS_FILE_SHARD_BYTES in MiB")
    parser.add_argument("--workers", type=int, default=2, help="`dcs worker` processes")
    parser.add_argument("--dir", type=Path, default=None, help="where files are written (default: a temp dir)")
    args = parser.parse_args()
    if args.saves <= WARMUP:
        parser.error(f"--saves must be more than {WARMUP}")
    root = Path(tempfile.mkdtemp(prefix="dcs-bench-incr-", dir=args.dir))
    try:
        rows = run(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    results = {"args": {k: str(v) for k, v in vars(args).items()}, "saves": rows, "summary": summarize(rows)}
    q = results["summary"]
    row = Row(
        what=f"incremental saves, {args.size_mb} MiB state with frozen weights",
        ours=f"{q['written_fraction']:.3f} of the bytes written per save; stall "
        f"{q['stall_incremental_s'] * 1e3:.0f} ms; durable {q['durable_incremental_s']:.2f} s",
        compared=f"full saves in the same run: stall {q['stall_full_s'] * 1e3:.0f} ms, durable "
        f"{q['durable_full_s']:.2f} s",
        ratio=q["written_fraction"],
        ratio_text=f"{q['written_fraction']:.3f} of the bytes; stall {q['stall_ratio']:.2f}x; durable "
        f"{q['durable_speedup']:.2f}x faster",
        target="~10% of the bytes, stall unchanged",
        met=None,
    )
    bench_run.record(results, [row])
    for mode, mode_rows in rows.items():
        for r in mode_rows:
            times = f"stall {r['stall_s'] * 1e3:7.1f} ms, durable {r['durable_s']:6.2f} s"
            sizes = f"wrote {r['written'] / MiB:7.1f} of {r['bytes'] / MiB:7.1f} MiB (on disk {r['on_disk'] / MiB:.1f})"
            print(f"{mode:>11} step {r['step']:2d}: {times}, {sizes}")
    for key, value in results["summary"].items():
        print(f"{key:>24}: {value:.3f}")


if __name__ == "__main__":
    main()
