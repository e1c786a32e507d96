"""The host agent of a real `dcs worker` against a local client that holds the token: an `adopt` claiming a node
with a wrong identity does not displace the live node (409, as the same claim gets over HTTP), and a client that
sends renewals without reading the answers is cut off instead of growing the worker's memory. A real
`dcs coordinator`, redis-server, `dcs worker` and Unix sockets."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr

from dcs_tasks.config import DCSConfig, RoleInfo
from dcs_tasks.coordinator_api import CoordinatorAPI
from dcs_tasks.hostagent import NodeLiveness, agent_socket_path
from tests.helpers.ports import free_port
from tests.helpers.procs import CoordinatorProcess, WorkerProcess
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.integration
TOKEN = "agent-fencing-token"
RENEWAL = b'{"op": "renew"}\n'
FLOOD_BYTES = 7 * 1024 * 1024  # what grew the worker from 99 to 220 MiB before answers were written with backpressure


@pytest.fixture
def stack(dcs_config: DCSConfig, tmp_path: Path) -> Iterator[tuple[DCSConfig, WorkerProcess]]:
    """A coordinator with a token and a `dcs worker` serving the host agent for it."""
    base = dcs_config.model_copy(update={"auth_token": SecretStr(TOKEN)})
    coordinator = CoordinatorProcess(base, tmp_path / "coordinator.log").start()
    config = base.model_copy(update={"coordinator_url": coordinator.url, "host_agent_socket": tmp_path / "agent.sock"})
    worker = WorkerProcess(config, tmp_path / "worker.log", concurrency=1)
    try:
        worker.start()
        wait_until(lambda: answers(agent_socket_path(config)), 30, f"the worker's agent; log: {worker.log_tail()}")
        yield config, worker
    finally:
        worker.discard()
        coordinator.stop()


def answers(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


def hello(config: DCSConfig, op: str, node: dict[str, Any], identity: str = "") -> bytes:
    body = {"v": 1, "op": op, "token": TOKEN, "coordinator": config.base_url, "node": node, "lease_ms": 1500}
    return json.dumps(body | {"identity": identity}).encode() + b"\n"


def first_answer(conn: socket.socket) -> dict[str, Any]:
    """The agent's answer to the hello, read byte by byte: nothing after it is consumed."""
    line = b""
    while not line.endswith(b"\n"):
        byte = conn.recv(1)
        if not byte:
            break
        line += byte
    return dict(json.loads(line))


def adopt_once(path: Path, line: bytes) -> dict[str, Any]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(15)
        conn.connect(str(path))
        conn.sendall(line)
        return first_answer(conn)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


async def test_an_adopt_with_a_wrong_identity_does_not_displace_a_live_node(
    stack: tuple[DCSConfig, WorkerProcess],
) -> None:
    config, _ = stack
    path = agent_socket_path(config)
    api = CoordinatorAPI(config.base_url, TOKEN, timeout=10)
    port = free_port()
    node = RoleInfo(role_name="receiver", rank=0, ip="127.0.0.1", port=port)
    liveness = NodeLiveness(api, config, node, lease_s=5.0)  # fresh throughout, even on a loaded machine
    try:
        assert (await liveness.register()).identity == f"127.0.0.1:{port}" and liveness.via_agent
        liveness.start()
        wrong = {"role_name": "receiver", "rank": 0, "ip": "127.0.0.1", "port": port + 1}
        by_identity = await asyncio.to_thread(adopt_once, path, hello(config, "adopt", wrong, "10.6.6.6:6666"))
        by_address = await asyncio.to_thread(adopt_once, path, hello(config, "adopt", wrong))
        await asyncio.sleep(config.heartbeat.timeout_seconds + 2 * config.heartbeat.interval_seconds)
        assert liveness.lost is None, f"the live node lost its rank: {liveness.lost}; the adopt got {by_identity}"
        assert liveness.via_agent and liveness.running
        assert 0 in (await api.topology()).nodes.get("receiver", {}), "the live node left the topology"
        for answer in (by_identity, by_address):
            assert answer["ok"] is False and answer["status"] == 409 and answer["source"] == "coordinator", answer
        # the right identity does not take a lease its process still renews either
        right = {"role_name": "receiver", "rank": 0, "ip": "127.0.0.1", "port": port}
        answer = await asyncio.to_thread(adopt_once, path, hello(config, "adopt", right))
        assert answer["status"] == 409 and answer["source"] == "agent" and "renews it" in answer["detail"], answer
        await asyncio.sleep(2 * config.heartbeat.interval_seconds)
        assert liveness.lost is None and liveness.via_agent
    finally:
        await liveness.stop()
        await api.aclose()


def test_a_client_that_does_not_read_its_answers_is_cut_off(stack: tuple[DCSConfig, WorkerProcess]) -> None:
    config, worker = stack
    assert worker.proc is not None
    node = {"role_name": "actor", "rank": 0, "ip": "127.0.0.1", "port": free_port()}
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(20)
        conn.connect(str(agent_socket_path(config)))
        conn.sendall(hello(config, "register", node))
        assert first_answer(conn)["ok"]
        before = rss_mib(worker.proc.pid)
        chunk, sent, cut = RENEWAL * 4096, 0, None
        try:
            while sent < FLOOD_BYTES:  # renewals, their answers never read
                conn.sendall(chunk)
                sent += len(chunk)
        except OSError as exc:
            cut = exc
        time.sleep(1.0)  # the agent works through what it took
        after = rss_mib(worker.proc.pid)
    figures = f"{sent / 2**20:.2f} MiB of renewals sent; worker RSS {before:.0f} -> {after:.0f} MiB"
    print(figures)
    assert cut is not None, f"never cut off: {figures}"
    assert sent < 1024 * 1024 and after - before < 16, figures
