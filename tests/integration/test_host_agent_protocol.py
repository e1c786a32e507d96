"""The host agent's socket against hostile local clients (named errors, bounds), and a process whose agent breaks
the protocol registering and beating by itself (a real `dcs coordinator` process and redis-server). The agent
is `workers/agent.py`'s HostAgent in this process (its own thread and loop, a real Unix socket)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr

from dcs_tasks.config import DCSConfig, RoleInfo
from dcs_tasks.coordinator_api import CoordinatorAPI
from dcs_tasks.errors import RankConflict
from dcs_tasks.hostagent import MAX_MESSAGE_BYTES, NodeLiveness
from tests.helpers.procs import CoordinatorProcess
from tests.helpers.waiting import wait_until
from workers.agent import HostAgent

pytestmark = pytest.mark.integration
TOKEN = "agent-test-token"


@pytest.fixture
def agent(dcs_config: DCSConfig, tmp_path: Path) -> Iterator[HostAgent]:
    """An agent for a real coordinator: it checks an adopt's identity there (a node it does not know is taken)."""
    with_token = dcs_config.model_copy(update={"auth_token": SecretStr(TOKEN)})
    coordinator = CoordinatorProcess(with_token, tmp_path / "coordinator.log").start()
    config = DCSConfig(
        host_agent_socket=tmp_path / "agent.sock",
        auth_token=SecretStr(TOKEN),
        coordinator_url=coordinator.url,
        heartbeat_interval_seconds=0.5,
        heartbeat_timeout_seconds=2.0,
    )
    host_agent = HostAgent(config)
    try:
        assert host_agent.start()
        yield host_agent
    finally:
        host_agent.stop()
        coordinator.stop()


def ask(path: Path, *lines: bytes) -> list[dict[str, Any]]:
    """Send `lines` on one connection; every answer line until the agent closes it (or 5 s pass)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(5)
        conn.connect(str(path))
        for line in lines:
            conn.sendall(line)
        data = b""
        try:
            while chunk := conn.recv(65536):
                data += chunk
        except TimeoutError:
            pass
    return [json.loads(line) for line in data.splitlines()]


def hello(url: str, op: str = "adopt", **changes: Any) -> bytes:
    body = {
        "v": 1,
        "op": op,
        "token": TOKEN,
        "coordinator": url,
        "node": {"role_name": "actor", "rank": 3, "ip": "10.0.0.1", "port": 7003},
        "lease_ms": 1000,
    } | changes
    return json.dumps(body).encode() + b"\n"


def test_hostile_lines_get_named_errors_and_the_connection_closed(agent: HostAgent) -> None:
    path, url = agent.path, agent.config.base_url
    [answer] = ask(path, b"not json\n")
    assert answer["status"] == 400 and "not an AgentHello" in answer["detail"]
    [answer] = ask(path, hello(url, token="wrong"))
    assert answer["status"] == 401 and "token" in answer["detail"]
    [answer] = ask(path, hello(url, coordinator="http://10.9.9.9:8000"))
    assert answer["status"] == 400 and f"beats for {url}" in answer["detail"]
    [answer] = ask(path, hello(url, lease_ms=10**9))
    assert answer["status"] == 400 and "lease_ms" in answer["detail"]
    [answer] = ask(path, hello(url, node={"role_name": "actor", "rank": None, "ip": "10.0.0.1", "port": 0}))
    assert answer["status"] == 400 and "adopt needs" in answer["detail"]
    [answer] = ask(path, b"x" * (MAX_MESSAGE_BYTES + 10) + b"\n")
    assert answer["status"] == 413 and str(MAX_MESSAGE_BYTES) in answer["detail"]
    adopted, refused = ask(path, hello(url), b'{"op": "bogus"}\n')
    assert adopted["ok"] and adopted["identity"] == "10.0.0.1:7003" and adopted["rank"] == 3
    assert refused["status"] == 400 and "not a renewal" in refused["detail"]
    wait_until(lambda: not agent.leases, 5, "the refused connection's lease gone")


def test_a_renewing_connection_holds_a_lease_and_its_close_drops_it(agent: HostAgent) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(5)
        conn.connect(str(agent.path))
        reader = conn.makefile("rb")
        conn.sendall(hello(agent.config.base_url))
        assert json.loads(reader.readline())["ok"]
        conn.sendall(b'{"op": "renew"}\n')
        assert json.loads(reader.readline()) == {"ok": True, "identity": "10.0.0.1:7003"}
        assert list(agent.leases) == [("actor", 3)]
        reader.close()
    wait_until(lambda: not agent.leases, 5, "the lease dropped at EOF")


async def test_a_process_whose_agent_breaks_the_protocol_registers_and_beats_itself(
    dcs_config: DCSConfig, tmp_path: Path
) -> None:
    """A socket that answers garbage is no agent: the node registers with the coordinator itself and stays
    alive with its own beats."""
    path = tmp_path / "liar.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(8)
    stop = threading.Event()

    def liar() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                conn.recv(65536)
                conn.sendall(b'{"ok": "maybe", "rank": -4}\n')

    thread = threading.Thread(target=liar, daemon=True)
    thread.start()
    coordinator = CoordinatorProcess(dcs_config, tmp_path / "coordinator.log").start()
    config = dcs_config.model_copy(update={"host_agent_socket": path, "coordinator_url": coordinator.url})
    api = CoordinatorAPI(coordinator.url, timeout=10)
    liveness = NodeLiveness(api, config, RoleInfo(role_name="actor", rank=5, ip="10.0.0.1", port=7005))
    try:
        answer = await liveness.register()
        assert answer.rank == 5 and answer.identity == "10.0.0.1:7005" and not liveness.via_agent
        liveness.start()
        await asyncio.sleep(3 * config.heartbeat.timeout_seconds / 2)  # past one timeout: only its own beats hold it
        assert 5 in (await api.topology()).nodes.get("actor", {})
        assert liveness.running and liveness.lost is None and not liveness.via_agent
    finally:
        await liveness.stop()
        await api.aclose()
        coordinator.stop()
        stop.set()
        thread.join(5)
        server.close()


async def test_a_restarted_process_gets_the_rank_its_frozen_predecessor_held_within_its_wait(
    dcs_config: DCSConfig, tmp_path: Path
) -> None:
    """A trainer (no port: a new identity each registration) whose predecessor froze with its agent link open
    (the event loop stopped turning; a process that left its loop without closing the link looks the same)
    registers within `predecessor_wait_s`: the agent beats the frozen node until its lease is over, and only
    then does the coordinator's TTL start. The wait once left the lease out and lost this race on a loaded CI
    machine (a 409 from the seed client example run twice)."""
    coordinator = CoordinatorProcess(dcs_config, tmp_path / "coordinator.log").start()
    config = dcs_config.model_copy(
        update={"host_agent_socket": tmp_path / "agent.sock", "coordinator_url": coordinator.url}
    )
    host_agent = HostAgent(config)
    assert host_agent.start()
    frozen_loop = asyncio.new_event_loop()
    thaw = threading.Event()
    first_api = CoordinatorAPI(coordinator.url, timeout=10)
    first = NodeLiveness(first_api, config, RoleInfo(role_name="actor", rank=0))
    api = CoordinatorAPI(coordinator.url, timeout=10)
    second = NodeLiveness(api, config, RoleInfo(role_name="actor", rank=0))
    runner = threading.Thread(target=frozen_loop.run_forever, daemon=True)
    runner.start()

    def in_first_loop(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, frozen_loop).result(30)

    try:
        held = in_first_loop(first.register())
        frozen_loop.call_soon_threadsafe(first.start)
        wait_until(lambda: first.renewals >= 2, 10, "the first process renewing its lease")
        frozen_loop.call_soon_threadsafe(thaw.wait, 60)  # its event loop stops turning; the link stays open
        assert held.rank == 0 and first.via_agent
        with pytest.raises(RankConflict):
            await second.register()  # still beaten by the agent
        started = time.monotonic()
        answer = await second.register(wait_for_rank_s=second.predecessor_wait_s)
        waited = time.monotonic() - started
        assert answer.rank == 0 and answer.identity != held.identity and second.via_agent
        assert waited > config.heartbeat.timeout_seconds / 2, waited  # it did wait out the predecessor's TTL
        second.start()
        assert 0 in (await api.topology()).nodes["actor"]
    finally:
        thaw.set()
        with contextlib.suppress(Exception):
            in_first_loop(first.stop())
            in_first_loop(first_api.aclose())
        frozen_loop.call_soon_threadsafe(frozen_loop.stop)
        runner.join(10)
        frozen_loop.close()
        await second.stop()
        await api.aclose()
        host_agent.stop()
        coordinator.stop()
