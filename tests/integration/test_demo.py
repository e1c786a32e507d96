"""`make demo` runs end to end: crash, bit-exact resume, weight push to two receivers."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers.procs import REPO

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_demo_passes() -> None:
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, str(REPO / "examples" / "demo.py")],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=REPO,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "restored step 40 is bit-exact" in done.stdout
    assert "final state equals an uninterrupted run" in done.stdout
    assert "both receivers hold bit-exact weights" in done.stdout
    assert "demo passed" in done.stdout
