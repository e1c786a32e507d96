"""The real Procfile under the real honcho: one port variable moves every process, and Ctrl-C stops them all.

The environment file is `.env.example` with its ports changed, as a user would write `.env`; it also names a
decoy Redis in `DCS_REDIS_URL` (a value left in the environment for another deployment, or the 6379 the
coordinator and worker fell back to): the processes of the Procfile must use the Redis the Procfile starts.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from dcs_tasks.celery_app import node_queue
from dcs_tasks.keys import Keys
from tests.helpers.ports import free_port, wait_for_port
from tests.helpers.procs import REPO
from tests.helpers.redis_server import RedisServer

pytestmark = pytest.mark.integration

HONCHO = Path(sys.executable).with_name("honcho")
NODE = "procfilehost"
READY_TIMEOUT = 120.0
STOP_TIMEOUT = 30.0  # honcho itself SIGKILLs what is left 5 s after the first process stopped


def env_file(tmp_path: Path, values: dict[str, str]) -> Path:
    """`.env.example` with `values` set (a commented-out `# NAME=` line is uncommented), as a user writes `.env`."""
    lines = (REPO / ".env.example").read_text().splitlines()
    seen: set[str] = set()
    out = []
    for line in lines:
        match = re.match(r"^#?\s*([A-Z][A-Z0-9_]*)=", line)
        if match and match[1] in values:
            seen.add(match[1])
            line = f"{match[1]}={values[match[1]]}"
        out.append(line)
    out += [f"{name}={value}" for name, value in values.items() if name not in seen]
    path = tmp_path / "dotenv"
    path.write_text("\n".join(out) + "\n")
    return path


def descendants(root: int) -> set[int]:
    """Every live process below `root` (the whole tree under honcho: shells, servers, prefork children)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        parents.setdefault(ppid, []).append(int(entry.name))
    found: set[int] = set()
    todo = [root]
    while todo:
        for child in parents.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class Honcho:
    def __init__(self, tmp_path: Path, dotenv: Path) -> None:
        self.log_path = tmp_path / "honcho.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DCS_", "FLOWER_"))}
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        env["PYTHONPATH"] = str(REPO)
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [str(HONCHO), "start", "--no-colour", "-f", str(REPO / "Procfile"), "-e", str(dotenv), "-d", str(REPO)],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def interrupt(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(STOP_TIMEOUT)

    def cleanup(self, pids: set[int]) -> None:
        """After a failure: nothing of this test may outlive it."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        for pid in pids | descendants(self.proc.pid):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def decoy(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "decoy")
    server.start()
    yield server
    server.stop()


def wait_for(predicate: object, timeout: float, what: str, honcho: Honcho) -> None:
    assert callable(predicate)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if honcho.proc.poll() is not None:
            raise AssertionError(f"honcho exited early while waiting for {what}:\n{honcho.log()[-4000:]}")
        try:
            if predicate():
                return
        except (redis.RedisError, httpx.HTTPError):
            pass
        time.sleep(0.25)
    raise AssertionError(f"{what} not seen within {timeout}s:\n{honcho.log()[-4000:]}")


def test_procfile_uses_the_chosen_redis_port_everywhere_and_stops_redis_last(
    tmp_path: Path, decoy: RedisServer
) -> None:
    redis_port, coordinator_port, flower_port = free_port(), free_port(), free_port()
    dotenv = env_file(
        tmp_path,
        {
            "DCS_REDIS_PORT": str(redis_port),
            "DCS_REDIS_DIR": str(tmp_path / "redis-data"),
            "DCS_COORDINATOR_PORT": str(coordinator_port),
            "DCS_FLOWER_PORT": str(flower_port),
            "DCS_WORKER_CONCURRENCY": "2",
            "DCS_NODE_NAME": NODE,
            "DCS_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
            "DCS_ENABLE_METRICS": "false",
            "DCS_REDIS_URL": decoy.url,  # must not win over DCS_REDIS_PORT
        },
    )
    honcho = Honcho(tmp_path, dotenv)
    chosen = redis.Redis(port=redis_port, socket_timeout=5, decode_responses=True)
    presence = Keys("dcs").worker_presence(node_queue(NODE))
    seen: set[int] = set()
    try:
        wait_for(
            lambda: chosen.exists(presence), READY_TIMEOUT, "the worker's presence key in the chosen Redis", honcho
        )
        wait_for_port(coordinator_port, READY_TIMEOUT)
        node = {"role_name": "actor", "rank": 0, "world_size": 1, "ip": "127.0.0.1", "port": 1234}
        answer = httpx.post(f"http://127.0.0.1:{coordinator_port}/register", json=node, timeout=30)
        assert answer.status_code == 200, answer.text
        assert any("actor" in key for key in chosen.keys("*")), "the coordinator did not write to the chosen Redis"

        wait_for_port(flower_port, READY_TIMEOUT)
        flower = f"http://127.0.0.1:{flower_port}/api/workers"
        wait_for(
            lambda: f"dcs@{NODE}" in httpx.get(flower, params={"refresh": "1"}, timeout=30).json(),
            READY_TIMEOUT,
            "the worker in Flower's API (unauthenticated on loopback)",
            honcho,
        )
        seen = descendants(honcho.proc.pid)

        decoy_client = decoy.client()
        assert decoy_client.dbsize() == 0
        clients = [c for c in decoy_client.client_list() if c["id"] != str(decoy_client.client_id())]
        assert clients == [], f"processes connected to the decoy Redis: {clients}"

        started = time.monotonic()
        honcho.interrupt()
        stop_seconds = time.monotonic() - started
        log = honcho.log()
        left = [pid for pid in seen if alive(pid)]
        assert left == [], f"still running {stop_seconds:.1f}s after SIGINT: {left}\n{log[-3000:]}"
        order = [m[1] for m in re.finditer(r"system\s+\| (\w+)\.1 stopped", log)]
        assert order.index("redis") > max(order.index("coordinator"), order.index("flower")), order
        assert "User requested shutdown" in log  # a graceful SHUTDOWN (AOF flushed), not a kill
        with pytest.raises(OSError):
            wait_for_port(redis_port, timeout=0.5)
    finally:
        honcho.cleanup(seen)
