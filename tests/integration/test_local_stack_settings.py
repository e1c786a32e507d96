"""`dcs up` and the settings a trainer shares with it.

- A `DCS_REDIS_URL` left in the shell from an earlier stack's dcs.env (its Redis gone with it): as met, `dcs up`
  hung 92 s and then blamed the worker. Now it checks that Redis first and fails within seconds, naming the URL
  (password masked) and where it came from.
- `dcs.env` carries every setting `dcs up` was started with: as met, a memory tier given to `dcs up` did not
  reach the trainer that sourced dcs.env (no memory tier, silently). A trainer environment built from the file
  passes `dcs doctor`, settings agreement included.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.procs import REPO
from tests.helpers.waiting import read_until
from tests.integration.local_support import clean_env, interrupt, kill_wrapper, leftovers, start_reaped
from tests.integration.test_local_stack import env_file_values

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def dead_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_stale_redis_url_fails_dcs_up_within_seconds_naming_it_masked(tmp_path: Path) -> None:
    port, report = dead_port(), tmp_path / "left.json"
    env = clean_env(DCS_REDIS_URL=f"redis://:stale-password-1@127.0.0.1:{port}/0")
    proc = start_reaped(["up", "--workdir", str(tmp_path / "run"), "--no-flower"], report, env, REPO)
    began = time.monotonic()
    try:
        out, _ = proc.communicate(timeout=30)  # the default per-process timeout is 90 s
    finally:
        kill_wrapper(proc)
    took = time.monotonic() - began
    assert proc.returncode == 1, out
    assert f"redis://:***@127.0.0.1:{port}/0" in out and "DCS_REDIS_URL" in out and "does not answer" in out, out
    assert "stale-password-1" not in out and "worker" not in out.split("does not answer")[0], out
    assert leftovers(report) == []
    print(f"dcs up refused the stale DCS_REDIS_URL after {took:.1f} s")
    assert took < 15


@pytest.fixture
def memory_dir(tmp_path: Path) -> Iterator[Path]:
    path = Path("/dev/shm") / f"dcs-test-up-{os.getpid()}-{tmp_path.name}"
    path.mkdir(mode=0o700)
    yield path
    subprocess.run(["rm", "-rf", str(path)], check=False)


def test_dcs_env_carries_every_setting_dcs_up_was_started_with_and_a_trainer_from_it_agrees(
    tmp_path: Path, memory_dir: Path
) -> None:
    workdir, report = tmp_path / "run", tmp_path / "left.json"
    started_with = {
        "DCS_MEMORY_TIER_BYTES": str(64 * 1024 * 1024),
        "DCS_MEMORY_DIR": str(memory_dir),
        "DCS_STORAGE_EVERY_STEPS": "4",
        "DCS_KEEP_LAST": "3",
    }
    proc = start_reaped(["up", "--workdir", str(workdir), "--no-flower"], report, clean_env(**started_with), REPO)
    try:
        read_until(proc, "Ctrl-C stops everything.", timeout=150)
        values = env_file_values(workdir / "dcs.env")
        for name, value in started_with.items():
            assert values.get(name) == value, f"{name} missing from dcs.env: {values.keys()}"
        trainer = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(REPO), **values}
        argv = [sys.executable, "-m", "dcs_tasks.cli.main", "doctor"]
        done = subprocess.run(argv, env=trainer, capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "ok    settings agree" in done.stdout, done.stdout
        rest = interrupt(proc, report)
    finally:
        kill_wrapper(proc)
    assert proc.returncode == 0, rest
