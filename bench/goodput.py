"""Goodput of a training loop that checkpoints, and recovery time (issue 19, the memory tier).

One CPU training loop in this process: an MLP (`--layers` Linear(`--width`, `--width`) + GELU) trained by fused
AdamW on a fixed batch of `--batch` rows, `--threads` torch threads. Defaults: 5 x 2112 wide, so the saved state
(weights + AdamW's exp_avg and exp_avg_sq + its step counters) is 255 MiB; batch 96 and 1 thread make a step
~0.25 s on this 2-core VM when it is quiet (0.23-0.26 s; batch 32: 0.15 s, 64: 0.2 s), longer under other jobs'
load (the second core is left to the checkpoint machinery, as a GPU trainer leaves its host CPUs).
Each segment runs `--steps` timed steps (after untimed ones up to a multiple of 8, so the storage rule below
picks the same steps in every segment) under one mode:
  none      no saves (the reference)
  memory    DCS with the memory tier on (`memory_tier_bytes`, `memory_dir` on tmpfs, `memory_keep_last` 2): every
            save is committed in this host's memory, storage gets every step divisible by `--storage-every` (8).
            Budget: `--storage-every` + 4 steps (a step leaves memory only once a newer one is in storage or a
            peer's memory; a save that does not fit goes to storage only, counted as `to_storage_only`)
  storage   DCS without it, as before the memory tier: every save persisted to `checkpoint_dir` (fsync)
  dcp       torch.distributed.checkpoint.async_save (one process, gloo group of 1, a FileSystemWriter per
            checkpoint, fsync on), the previous save's future awaited before the next save (DCP's docs)
with a save after every step divisible by N, N in `--every` (1 and 4). Both DCS modes save with `overlap=True`
(the copy into staging beside the next forward/backward, the optimizer step waiting for it; `--no-overlap`: the
copy inside `save`), and their stall is the call plus that wait. Every segment's saves are drained after
it (timed apart: `drain`) and the memory tier's storage copies waited for, so each segment starts from the same
state. A repetition (`--repeats`) runs every mode/frequency once, in an order rotated by one per repetition,
each segment followed by a `none` one, so every segment with saves sits between two without: its goodput = the
mean loop time of those two / its own (same steps), and a mode's goodput the median over the repetitions (the
machine is shared: its load drifts). Load average recorded at each segment and for the run.

Recovery: `restore(into=)` the live model + AdamW state (verified), from the call to the state in the tensors,
by a fresh Checkpointer as a restarted trainer would make it: from this host's memory (memory tier; sealed files,
hashed on arrival, as restore reads them by default, and again with every byte hashed on restore); from
storage with the page cache dropped (`sync; echo 1 > /proc/sys/vm/drop_caches`, root only: otherwise the figure
is warm and says so) and warm; from a peer: host A's worker (`memory_replicas`) copies its step to the memory of
peer workers (own DCS_NODE_NAME, `memory_dir`, peer server), A's worker is stopped, and a fresh trainer on host C
(empty memory) restores, pulling the step from a peer: on loopback, and (`--netns`, default when root) from a
worker in a network namespace behind a veth pair. `dcp.load` of DCP's newest checkpoint, cache dropped, for comparison.

`--memory-tmpfs DIR` puts the memory tiers on another tmpfs (e.g. one mounted huge=within_size; its mount options
are recorded) and records the run as benchmark `goodput_memory_tmpfs`.

A private redis-server and real `dcs worker` processes (bench/harness.py). The parts: bench/goodput_loop.py (the
training loop, the savers, the timed segments), bench/goodput_stack.py (Redis and the workers as hosts),
bench/goodput_recovery.py (the recovery figures); this file parses the arguments, runs them and reports. Prints
a table; writes a result file under bench/results/goodput/. `--quick`: a small model, a few steps, one
repetition (a smoke run).
"""

from __future__ import annotations

import argparse
import contextlib
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

from bench.goodput_loop import DCPSaver, DCSSaver, Saver, Trainer, goodput, init_dist, run_segments
from bench.goodput_recovery import recovery
from bench.goodput_stack import Stack, Veth, memory_settings, memory_tier_missing, mount_options, start_redis
from bench.harness import Row, Run, stop
from dcs_tasks import Checkpointer

MiB = 1 << 20
MODES = ("none", "memory", "storage", "dcp")
GOODPUT_TARGET = 0.85  # memory tier, a save every step
RECOVERY_TARGET = 10.0  # from memory vs from storage with the page cache dropped


# --- main ------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=32, help="timed training steps per segment (default 32)")
    parser.add_argument("--repeats", type=int, default=3, help="repetitions of every segment (default 3)")
    parser.add_argument("--warmup", type=int, default=4, help="untimed training steps first (default 4)")
    parser.add_argument("--every", type=int, nargs="+", default=[1, 4], help="save every N steps (default 1 4)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--width", type=int, default=2112, help="MLP width (default 2112: 255 MiB saved)")
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--batch", type=int, default=96, help="rows per step: sets the step time (default 96)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the training loop (default 1)")
    parser.add_argument("--storage-every", type=int, default=8, help="memory tier: storage every N steps (8)")
    parser.add_argument("--memory-keep-last", type=int, default=2, help="memory tier: steps kept in memory (2)")
    parser.add_argument(
        "--memory-tier-mib", type=int, default=0, help="memory tier budget (default: storage-every + 4 steps)"
    )
    parser.add_argument(
        "--memory-tmpfs",
        type=Path,
        default=None,
        help="put the memory tiers on this tmpfs instead of /dev/shm (e.g. one mounted huge=within_size); "
        "the run is recorded as benchmark goodput_memory_tmpfs",
    )
    parser.add_argument("--worker-concurrency", type=int, default=2)
    parser.add_argument("--recovery-repeats", type=int, default=3)
    parser.add_argument("--no-peer", action="store_true", help="skip the recovery from a peer's memory")
    parser.add_argument(
        "--no-overlap", action="store_true", help="DCS saves copy before returning (no save(overlap=True))"
    )
    parser.add_argument(
        "--netns",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also recover from a peer in a network namespace behind a veth pair (default: when root)",
    )
    parser.add_argument("--dir", type=Path, default=None, help="storage and DCP files (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=None, help="the result file (default: bench/results/...)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (worker logs) for a look")
    parser.add_argument("--quick", action="store_true", help="smoke run: small model, 8 steps, 1 repetition")
    args = parser.parse_args(argv)
    if args.netns is None:
        args.netns = os.geteuid() == 0
    if args.quick:
        args.width, args.layers, args.batch = 512, 2, 8
        args.steps, args.repeats, args.warmup, args.recovery_repeats = 8, 1, 1, 1
    return args


def main() -> None:
    args = parse_args()
    run_ = Run("goodput_memory_tmpfs" if args.memory_tmpfs else "goodput")
    load_start = os.getloadavg()
    torch.set_num_threads(args.threads)
    trainer = Trainer(args.width, args.layers, args.batch)
    for _ in range(max(1, args.warmup)):  # AdamW's state exists from the first step on
        trainer.step()
    state_bytes = trainer.saved_bytes()
    notes: list[str] = []
    figures: dict[str, Any] = {
        "model": {
            "width": args.width,
            "layers": args.layers,
            "batch": args.batch,
            "threads": args.threads,
            "saved_bytes": state_bytes,
            "optimizer": "AdamW(fused=True)",
        },
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
        "steps": args.steps,
        "repeats": args.repeats,
        "every": args.every,
        "storage_every_steps": args.storage_every,
        "memory_keep_last": args.memory_keep_last,
    }
    modes = list(args.modes)
    why = memory_tier_missing()
    if "memory" in modes and why:
        modes.remove("memory")
        notes.append(f"memory mode and every recovery from memory not run: {why}")
    veth = None
    if args.netns and "memory" in modes and not args.no_peer:
        try:
            veth = Veth.create()
        except (OSError, RuntimeError) as exc:
            notes.append(f"no veth peer: {exc}")
    if "dcp" in modes:
        init_dist()
    root = Path(tempfile.mkdtemp(prefix="dcs-bench-goodput-", dir=args.dir))
    shm = Path(tempfile.mkdtemp(prefix="dcs-bench-goodput-", dir="/dev/shm"))
    (root / "redis").mkdir()
    redis, url = start_redis(root / "redis", ["127.0.0.1", veth.outer] if veth else ["127.0.0.1"])
    memory_dir = None
    if args.memory_tmpfs:
        memory_dir = Path(tempfile.mkdtemp(prefix="dcs-bench-goodput-", dir=args.memory_tmpfs))
    stack = Stack(root, shm, url, memory=memory_dir)
    if args.memory_tmpfs:
        figures["memory_tmpfs"] = {"dir": str(args.memory_tmpfs), "mount": mount_options(args.memory_tmpfs)}
    savers: dict[str, Saver] = {"none": Saver()}
    overlap = None if args.no_overlap else trainer.opt
    figures["overlap"] = not args.no_overlap
    try:
        if "storage" in modes:
            config = stack.worker("bench-storage", args.worker_concurrency)
            savers["storage"] = DCSSaver(
                Checkpointer("goodput-storage", config, size_hint_bytes=state_bytes + 16 * MiB), opt=overlap
            )
        if "memory" in modes:
            settings = memory_settings(args, state_bytes, stack.memory_root / "memory-bench-memory")
            config = stack.worker("bench-memory", args.worker_concurrency, **settings)
            ckpt = Checkpointer("goodput-memory", config, size_hint_bytes=state_bytes + 16 * MiB)
            savers["memory"] = DCSSaver(ckpt, storage_every=args.storage_every, opt=overlap)
            figures["memory_tier_bytes"] = settings["memory_tier_bytes"]
        if "dcp" in modes:
            (root / "dcp").mkdir()
            savers["dcp"] = DCPSaver(root / "dcp")
        warm_up(trainer, savers)
        figures["step_s_alone"] = time_steps(trainer, 5)
        print(
            f"state {state_bytes / MiB:.0f} MiB ({args.layers} x {args.width}, AdamW); one step "
            f"{figures['step_s_alone'] * 1e3:.0f} ms (batch {args.batch}, {args.threads} thread(s)); "
            f"load {os.getloadavg()[0]:.2f}",
            flush=True,
        )
        segments = run_segments(trainer, savers, modes, args, stack.cpu_seconds)
        figures["segments"] = [{**vars(s), "key": s.key} for s in segments]
        figures["goodput"] = goodput(segments)
        figures["recovery"] = recovery(trainer, savers, stack, veth, args, notes)
    finally:
        for saver in savers.values():
            with contextlib.suppress(Exception):
                saver.close()
        stack.stop()
        stop(redis)
        if veth is not None:
            veth.destroy()
        if args.keep:
            print(f"kept {root} and {shm}")
        else:
            shutil.rmtree(root, ignore_errors=True)
            shutil.rmtree(shm, ignore_errors=True)
            if memory_dir is not None:
                shutil.rmtree(memory_dir, ignore_errors=True)
    if args.netns and veth is None and "memory" in modes and not args.no_peer:
        notes.append("peer over veth not measured")
    figures["load_start"] = [round(x, 2) for x in load_start]
    figures["load_end"] = [round(x, 2) for x in os.getloadavg()]
    report(figures, notes)
    run_.record(figures, summary(figures), notes="; ".join(notes), out=args.out, headline=headline(figures))


def warm_up(trainer: Trainer, savers: dict[str, Saver]) -> None:
    """Untimed saves per mode (staging buffers, memory files and DCP's stager allocated); the memory tier's are
    durable (`save(durable=True)`), so its workers have flushed to storage once before the timed segments."""
    for saver in savers.values():
        for _ in range(2):
            trainer.step()
            if isinstance(saver, DCSSaver) and saver.storage_every is not None:
                saver.pending.append(saver.ckpt.save(trainer.state(), step=trainer.global_step, durable=True))
                saver.last_durable = trainer.global_step
            else:
                saver.save(trainer)
            saver.drain()


def time_steps(trainer: Trainer, steps: int) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        trainer.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# --- output ----------------------------------------------------------------------------------------
def summary(figures: dict[str, Any]) -> list[Row]:
    rows = []
    gp = figures["goodput"]
    base = gp["none"]["loop_s"]
    steps = figures["steps"]
    size = figures["model"]["saved_bytes"] / MiB
    for key, g in gp.items():
        if key == "none":
            continue
        mode, every = key.split("/")
        judged = mode == "memory" and every == "1"
        rows.append(
            Row(
                what=f"goodput, {mode}, a save every {every} step(s) ({steps} steps, {size:.0f} MiB)",
                ours=f"{g['goodput']:.3f} (loop {g['loop_s']:.2f} s, stall p50 {g['stall_p50_s'] * 1e3:.0f} ms, "
                f"workers {g['worker_cpu_s'] / max(1, g['saves_per_segment']):.2f} CPU-s per save)",
                compared=f"no saves: loop {base:.2f} s",
                ratio=g["goodput"],
                ratio_text=f"goodput {g['goodput']:.3f}",
                target=f">= {GOODPUT_TARGET}" if judged else "",
                met=(g["goodput"] >= GOODPUT_TARGET) if judged else None,
            )
        )
    rec = figures.get("recovery", {})
    recoveries = (
        ("", "restore(into=) the live model + AdamW state", ""),
        ("_new", "restore() into new tensors (a restarted trainer's state)", ", the tmpfs pages lent, not copied"),
    )
    checks = (
        ("", "sealed files (hashed on arrival, stamp unchanged)", True),
        ("_hashed", 'every byte hashed again (memory_restore_verify="hash")', False),
    )
    for suffix, how, lent in recoveries:
        for check, checked, judged in checks:
            if f"storage_cold_vs_memory{suffix}{check}" not in rec:
                continue
            ratio = rec[f"storage_cold_vs_memory{suffix}{check}"]
            rows.append(
                Row(
                    what=f"recovery: {how}, {checked}",
                    ours=f"from memory {rec[f'memory{suffix}{check}']['median_s']:.3f} s{lent}"
                    + first_write(rec[f"memory{suffix}{check}"]),
                    compared=f"from storage, page cache dropped, {rec[f'storage_cold{suffix}']['median_s']:.3f} s",
                    ratio=ratio,
                    ratio_text=f"{ratio:.1f}x faster",
                    target=f">= {RECOVERY_TARGET:g}x" if judged else "",
                    met=ratio >= RECOVERY_TARGET if judged else None,
                )
            )
    for key in ("peer-loopback", "peer-veth"):
        if key in rec and "storage_cold" in rec:
            ratio = rec["storage_cold"]["median_s"] / rec[key]["median_s"]
            rows.append(
                Row(
                    what=f"recovery from a peer's memory ({key.removeprefix('peer-')}), fresh host, verified",
                    ours=f"{rec[key]['median_s']:.3f} s",
                    compared=f"from storage, page cache dropped, {rec['storage_cold']['median_s']:.3f} s",
                    ratio=ratio,
                    ratio_text=f"{ratio:.1f}x faster" if ratio >= 1 else f"{1 / ratio:.1f}x slower",
                )
            )
    return rows


def first_write(figures: dict[str, Any]) -> str:
    """What a first write to every page of restored new tensors cost (copy-on-write of lent pages)."""
    if "first_write_s" not in figures:
        return ""
    return f"; then a first write to every page {figures['first_write_s']:.3f} s"


def headline(figures: dict[str, Any]) -> str:
    """The README's line: goodput per mode with a save every step (and every 4), recovery ratios."""
    gp = figures.get("goodput", {})
    names = (("memory", "memory tier"), ("storage", "storage only"), ("dcp", "DCP async_save"))

    def row(every: int) -> list[str]:
        return [f"{gp[f'{m}/{every}']['goodput']:.2f} {label}" for m, label in names if f"{m}/{every}" in gp]

    parts = []
    if row(1):
        parts.append("save every step: goodput " + ", ".join(row(1)))
    if row(4):
        parts.append("every 4: " + " / ".join(x.split(" ", 1)[0] for x in row(4)))
    rec = figures.get("recovery", {})
    if "storage_cold_vs_memory_new" in rec:
        hashed = ""
        if "storage_cold_vs_memory_new_hashed" in rec:
            hashed = (
                f" (every byte hashed again: {rec['storage_cold_vs_memory_new_hashed']:.1f}x / "
                f"{rec.get('storage_cold_vs_memory_hashed', 0):.1f}x)"
            )
        parts.append(
            f"recovery from memory {rec['storage_cold_vs_memory_new']:.1f}x (new tensors) / "
            f"{rec.get('storage_cold_vs_memory', 0):.1f}x (into=) faster than cold storage{hashed}"
        )
    return "; ".join(parts)


def report(figures: dict[str, Any], notes: list[str]) -> None:
    gp = figures["goodput"]
    steps = figures["steps"]
    print(
        f"\n{'mode/every':12s} {'goodput':>8s} {'loop s':>7s} {'ms/step':>8s} {'saves':>6s} {'stall p50':>10s} "
        f"{'stall max':>10s} {'drain s':>8s} {'CPU s: trainer':>14s} {'workers':>7s}  "
        "goodput per repetition (none: its loop times)"
    )
    for key, g in gp.items():
        runs = g["loop_runs_s"] if key == "none" else g["goodput_runs"]
        print(
            f"{key:12s} {g['goodput']:8.3f} {g['loop_s']:7.2f} {g['loop_s'] / steps * 1e3:8.0f} "
            f"{g['saves_per_segment']:6d} "
            f"{g['stall_p50_s'] * 1e3:8.0f}ms {g['stall_max_s'] * 1e3:8.0f}ms {g['drain_s']:8.2f} "
            f"{g['trainer_cpu_s']:14.1f} {g['worker_cpu_s']:7.1f}  "
            f"{' '.join(f'{r:.3f}' if key != 'none' else f'{r:.2f}' for r in runs)}"
        )
    rec = figures.get("recovery", {})
    print()
    for key, r in rec.items():
        if isinstance(r, dict):
            print(
                f"recovery {key:14s} {r['median_s']:7.3f} s  runs {' '.join(f'{x:.3f}' for x in r['runs_s'])}; "
                f"read from {'/'.join(r['locations'])}{first_write(r)}"
            )
    for key, g in gp.items():
        if any(g["to_storage_only"]):
            print(f"{key}: saves sent to storage only, memory tier full, per repetition: {g['to_storage_only']}")
    if "storage_cold_vs_memory" in rec:
        print(f"recovery from memory: {rec['storage_cold_vs_memory']:.1f}x faster than from storage (cache dropped)")
    if "storage_cold_vs_memory_new" in rec:
        print(
            f"recovery into new tensors from memory: {rec['storage_cold_vs_memory_new']:.1f}x faster than from "
            "storage (cache dropped)"
        )
    print(f"load average: start {figures['load_start']}, end {figures['load_end']}")
    for note in notes:
        print(f"note: {note}")


if __name__ == "__main__":
    main()
