"""The demo's PNG timeline: loss over time above, and lanes of what ran when below (training steps of both
trainer processes, save stalls, asynchronous persists until durable, the restore, weight-sync phases).

matplotlib is optional (`pip install 'dcs[demo]'`): without it `draw_timeline` raises MatplotlibMissing
and the demo skips only the picture.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dcs_tasks.errors import DCSError

MIN_BAR_SECONDS = 0.04  # a 2 ms stall would be invisible at this scale: drawn at least this wide
COLORS = {"train0": "#4c72b0", "train1": "#55a868", "stall": "#c44e52", "persist": "#8172b2", "sync": "#dd8452"}


class MatplotlibMissing(DCSError):
    """matplotlib is not installed: the timeline PNG cannot be drawn."""


def draw_timeline(record: Any, path: Path) -> None:
    """Write the timeline of `record` (a dcs_tasks.local.demo.Record) to `path` as PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise MatplotlibMissing("matplotlib is not installed (pip install 'dcs[demo]' or 'matplotlib>=3.8')") from exc
    t0 = record.started
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 6.5), sharex=True, height_ratios=[2, 3])
    _loss(top, record, t0)
    lanes = _lanes(record, t0)
    for y, (_label, bars) in enumerate(lanes):
        for start, width, color in bars:
            bottom.broken_barh([(start, max(width, MIN_BAR_SECONDS))], (y - 0.35, 0.7), color=color)
    bottom.set_yticks(range(len(lanes)), [label for label, _ in lanes])
    bottom.invert_yaxis()
    bottom.set_xlabel("seconds since the demo started")
    for ax in (top, bottom):
        if record.killed_at is not None:
            ax.axvline(record.killed_at - t0, color="black", linestyle="--", linewidth=1)
        ax.grid(axis="x", alpha=0.3)
    if record.killed_at is not None:
        top.annotate(
            f"SIGKILL (step {record.kill_step})",
            (record.killed_at - t0, 1.0),
            xycoords=("data", "axes fraction"),
            ha="right",
            va="top",
            fontsize=9,
        )
    fig.suptitle("dcs demo: training, async checkpoints, SIGKILL, bit-exact resume, weight push")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _loss(ax: Any, record: Any, t0: float) -> None:
    for phase, label in ((0, "first trainer"), (1, "resumed trainer")):
        points = [(t1 - t0, loss) for _, _, t1, loss, p in record.steps if p == phase]
        if points:
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, color=COLORS[f"train{phase}"], linewidth=1.2, label=label)
    ax.set_ylabel("loss")
    ax.legend(loc="upper right", fontsize=8)


def _lanes(record: Any, t0: float) -> list[tuple[str, list[tuple[float, float, str]]]]:
    steps = [(a - t0, b - a, COLORS[f"train{p}"]) for _, a, b, _, p in record.steps]
    stalls = [(e["t0"] - t0, e["stall"], COLORS["stall"]) for e in record.saves]
    persists = [
        (e["t0"] + e["stall"] - t0, e["durable_at"] - e["t0"] - e["stall"], COLORS["persist"])
        for e in record.saves
        if e.get("durable_at")
    ]
    restore = []
    if record.restore:
        restore.append((record.restore["t"] - record.restore["seconds"] - t0, record.restore["seconds"], "#937860"))
    setup: list[tuple[float, float, str]] = []
    wire: list[tuple[float, float, str]] = []
    for sync in record.syncs:
        start = sync["t0"] - t0
        ready = float(sync.get("ready_seconds", sync.get("bootstrap_seconds", 0.0)))
        setup.append((start, ready, "#ccb974"))
        wire.append((start + ready, max(0.0, sync["t1"] - sync["t0"] - ready), COLORS["sync"]))
    stack = [(0.0, record.stack_ready - t0, "#8c8c8c")] if record.stack_ready else []
    first_steps = {p: a for _, a, _, _, p in reversed(record.steps)}  # phase -> start of its first step
    boots = [(at - t0, first_steps[p] - at, "#b0b0b0") for p, at in enumerate(record.spawned) if p in first_steps]
    return [
        ("stack start", stack),
        ("trainer start (import, restore)", boots),
        ("training steps", steps),
        ("save stall (trainer)", stalls),
        ("persist until durable (worker)", persists),
        ("restore", restore),
        ("sync: group + sessions", setup),
        ("sync: broadcast + close", wire),
    ]
