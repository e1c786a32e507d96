"""`dcs up`: the stack starts, answers, keeps the token off the terminal, and Ctrl-C leaves nothing running."""

from __future__ import annotations

import re
import stat
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers.procs import REPO
from tests.helpers.waiting import read_until
from tests.integration.local_support import (
    clean_env,
    interrupt,
    kill_wrapper,
    leftovers,
    start_reaped,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def env_file_values(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)


def test_dcs_up_serves_and_ctrl_c_stops_everything(tmp_path: Path) -> None:
    workdir, report = tmp_path / "run", tmp_path / "left.json"
    proc = start_reaped(["up", "--workdir", str(workdir), "--receivers", "1"], report, clean_env(), REPO)
    try:
        banner = read_until(proc, "Ctrl-C stops everything.", timeout=150)
        coordinator = re.search(r"coordinator\s+(http://127\.0\.0\.1:\d+)", banner)
        flower = re.search(r"flower\s+(http://127\.0\.0\.1:\d+)", banner)
        assert coordinator and flower, banner
        url = coordinator.group(1)
        assert httpx.get(f"{url}/healthz", timeout=10).status_code == 200

        env_file = workdir / "dcs.env"
        assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
        values = env_file_values(env_file)
        token = values["DCS_AUTH_TOKEN"]
        assert values["DCS_COORDINATOR_URL"] == url
        assert values["DCS_REDIS_URL"].startswith("redis://:")  # the private Redis has a password
        assert len(token) >= 32 and token not in banner
        assert values["DCS_REDIS_URL"] not in banner and "DCS_AUTH_TOKEN=***" in banner

        auth = {"Authorization": f"Bearer {token}"}
        assert httpx.get(f"{url}/topology", timeout=10).status_code == 401
        topology = httpx.get(f"{url}/topology", params={"role_filter": "rollout"}, headers=auth, timeout=10)
        assert "0" in topology.json()["nodes"]["rollout"]  # the receiver registered
        assert httpx.get(flower.group(1), timeout=10).status_code == 401
        assert httpx.get(flower.group(1), auth=("dcs", token), timeout=10).status_code == 200

        rest = interrupt(proc, report)
    finally:
        kill_wrapper(proc)
    assert proc.returncode == 0, rest
    assert "dcs up: stopped" in rest
    assert leftovers(report) == []
    assert not (workdir / "dcs.env").exists()  # the token dies with the stack


def test_dcs_up_reports_a_process_that_cannot_start(tmp_path: Path) -> None:
    """A stack that cannot come up stops what it started and says why (here: no Redis at DCS_REDIS_URL)."""
    report = tmp_path / "left.json"
    env = clean_env(DCS_REDIS_URL="redis://127.0.0.1:1/0", DCS_REDIS_SOCKET_TIMEOUT_SECONDS="0.5")
    args = ["up", "--workdir", str(tmp_path / "run"), "--no-flower", "--timeout", "20"]
    proc = start_reaped(args, report, env, REPO)
    try:
        out, _ = proc.communicate(timeout=150)
    finally:
        kill_wrapper(proc)
    assert proc.returncode == 1, out
    assert "not within 20s" in out or "exited with status" in out or "does not answer" in out
    assert leftovers(report) == []


def gone(pid: int) -> bool:
    """True once `pid` no longer runs (a zombie awaiting its reaper counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def wait_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_service_stop_ends_the_whole_process_group_even_when_sigterm_is_ignored(tmp_path: Path) -> None:
    from dcs_tasks.local.procs import Service

    pidfile = tmp_path / "grandchild.pid"
    script = f'trap "" TERM; sleep 300 & echo $! > {pidfile}; wait'
    service = Service("stubborn", ["sh", "-c", script], {"PATH": "/usr/bin:/bin"}, tmp_path / "log").start()
    assert service.pid is not None
    leader = service.pid
    deadline = time.monotonic() + 10
    while not pidfile.exists() or not pidfile.read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    grandchild = int(pidfile.read_text())
    started = time.monotonic()
    service.stop(timeout=1.0)
    assert time.monotonic() - started < 15
    assert wait_gone(leader) and wait_gone(grandchild)


def test_a_child_dies_with_its_parent(tmp_path: Path) -> None:
    """kill -9 of the process that started a stack service takes the service along (parent-death signal)."""
    import subprocess
    import sys

    code = (
        "import os, sys, time\n"
        "from pathlib import Path\n"
        "from dcs_tasks.local.procs import Service\n"
        f"s = Service('sleeper', ['sleep', '300'], dict(os.environ), Path({str(tmp_path / 'log')!r})).start()\n"
        "print(s.pid, flush=True)\n"
        "time.sleep(300)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert not gone(child)
        parent.kill()
        parent.wait(10)
        assert wait_gone(child)
    finally:
        if parent.poll() is None:
            parent.kill()


def test_a_second_stack_in_the_same_workdir_is_refused(tmp_path: Path) -> None:
    """Two private Redis servers appending to one AOF directory would corrupt it: the second `dcs up` refuses."""
    import fcntl
    import os

    workdir, report = tmp_path / "run", tmp_path / "left.json"
    workdir.mkdir()
    fd = os.open(workdir / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)  # what a running `dcs up` holds
    try:
        proc = start_reaped(["up", "--workdir", str(workdir), "--no-flower"], report, clean_env(), REPO)
        try:
            out, _ = proc.communicate(timeout=60)
        finally:
            kill_wrapper(proc)
    finally:
        os.close(fd)
    assert proc.returncode == 1, out
    assert f"another local stack is running in {workdir}" in out
    assert leftovers(report) == []
    assert not (workdir / "redis").exists()  # refused before anything started
