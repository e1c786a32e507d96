"""`dcs demo` runs end to end for real: SIGKILL mid-run, bit-exact resume, weight push to two receivers, the
summary and the PNG timeline; and neither a normal exit nor Ctrl-C leaves a process of its stack behind."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest

from tests.helpers.procs import REPO
from tests.integration.local_support import (
    clean_env,
    inherited_signals,
    interrupt,
    kill_wrapper,
    leftovers,
    start_reaped,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_dcs_demo_passes_and_leaves_nothing_running(tmp_path: Path) -> None:
    out, report = tmp_path / "out", tmp_path / "left.json"
    proc = start_reaped(["demo", "--steps", "60", "--out", str(out)], report, clean_env(), REPO)
    try:
        stdout, _ = proc.communicate(timeout=280)
    finally:
        kill_wrapper(proc)
    assert proc.returncode == 0, stdout[-6000:]
    assert leftovers(report) == []
    assert "demo passed" in stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["passed"] is True
    # saves every 6 steps, SIGKILL once step 39 is reported: the trainer resumes from the newest save before it
    assert summary["killed_at_step"] >= 39 and summary["save_every"] == 6
    assert 36 <= summary["restored_step"] <= summary["killed_at_step"] and summary["restored_step"] % 6 == 0
    assert summary["resumed_bit_exact"] is True
    assert summary["receivers_match"] is True
    assert summary["saves"] >= 10 and summary["stall_p50_ms"] > 0 and summary["durable_p50_ms"] > 0
    assert summary["loss_last"] < summary["loss_first"]
    assert "what it measured" in stdout and "save stall p50 / p99" in stdout
    assert not (out / "stack").exists()  # checkpoints and logs removed after a passing run (no --keep)
    if importlib.util.find_spec("matplotlib") is None:
        assert "timeline PNG skipped: matplotlib is not installed" in stdout
        pytest.skip("matplotlib is not installed here (pip install 'dcs[demo]'): the PNG was not checked")
    png = out / "timeline.png"
    assert summary["png"] == str(png) and f"timeline: {png}" in stdout.replace("\n", "")
    data = png.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 20_000


def test_ctrl_c_during_training_stops_the_stack(tmp_path: Path) -> None:
    out, report = tmp_path / "out", tmp_path / "left.json"
    proc = start_reaped(["demo", "--steps", "400", "--out", str(out)], report, clean_env(), REPO)
    seen = []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 150
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("1. training") or time.monotonic() > deadline:
                break
        assert any(line.startswith("1. training") for line in seen), "".join(seen)
        time.sleep(3)  # the trainer process is up
        rest = interrupt(proc, report)
    finally:
        kill_wrapper(proc)
    assert proc.returncode == 130, "".join(seen) + rest + f"\nwrapper started with {inherited_signals(report)}"
    assert "interrupted; everything it started is stopped" in rest
    assert leftovers(report) == []


def test_without_matplotlib_only_the_png_is_skipped_with_a_clear_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import io
    import sys

    from rich.console import Console

    from dcs_tasks.local.demo import Demo, DemoSettings

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    output = io.StringIO()
    demo = Demo(DemoSettings(steps=60, out=tmp_path), Console(file=output, width=200))
    assert demo.draw(tmp_path / "timeline.png") is False
    assert "timeline PNG skipped: matplotlib is not installed (pip install 'dcs[demo]'" in output.getvalue()
    assert not (tmp_path / "timeline.png").exists()
