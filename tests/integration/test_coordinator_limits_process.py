"""Real `dcs coordinator` processes under hostile clients: slow senders are cut off, a burst of long-polls is
served from a bounded Redis pool, and no secret reaches an answer, a log line or `dcs config`."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from pydantic import SecretStr

from dcs_tasks.config import DCSConfig, RoleInfo
from dcs_tasks.coordinator_api import CoordinatorAPI
from dcs_tasks.models import WeightMeta
from tests.helpers.ports import free_port, wait_for_port
from tests.helpers.procs import REPO, CoordinatorProcess
from tests.helpers.redis_server import RedisDB, RedisServer
from tests.helpers.testconfig import short_config

pytestmark = [pytest.mark.integration, pytest.mark.slow]
READ_TIMEOUT = 1.0  # the shared coordinator's coordinator_request_read_timeout_seconds


@dataclass(frozen=True)
class Shared:
    """The module's coordinator, the config it runs with and its Redis database."""

    config: DCSConfig
    coordinator: CoordinatorProcess
    database: RedisDB


@pytest.fixture(scope="module")
def shared(
    shared_redis: tuple[RedisServer, Iterator[int]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Shared]:
    """One `dcs coordinator` for the tests that neither stop Redis nor need settings of their own, on a config as
    `dcs_config` makes a test's (a database of its own on the shared redis-server) with a 1 s read bound."""
    server, indexes = shared_redis
    database = RedisDB(server, next(indexes))
    tmp = tmp_path_factory.mktemp("coordinator-limits")
    config = short_config(database.url, tmp, coordinator_request_read_timeout_seconds=READ_TIMEOUT)
    coordinator = CoordinatorProcess(config, tmp / "coordinator.log").start()
    try:
        yield Shared(config, coordinator, database)
    finally:
        coordinator.stop()
        database.flush()


def _slowloris(port: int, byte_interval_s: float, give_up_s: float) -> float | None:
    """Send a request head one byte at a time; seconds until the server closed the connection (None: never)."""
    head = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 10_000
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=give_up_s) as sock:
        sock.settimeout(byte_interval_s)
        for i in range(len(head)):
            if time.monotonic() - start > give_up_s:
                return None
            try:
                sock.sendall(head[i : i + 1])
                if sock.recv(1) == b"":
                    return time.monotonic() - start
            except TimeoutError:
                continue  # nothing to read yet: the server still waits for us
            except OSError:  # reset / broken pipe: closed by the server
                return time.monotonic() - start
    return None


async def test_a_client_sending_its_headers_slowly_is_cut_off_while_others_are_served(shared: Shared) -> None:
    coordinator = shared.coordinator
    slow = asyncio.create_task(asyncio.to_thread(_slowloris, coordinator.port, 0.1, 8.0))
    async with CoordinatorAPI(coordinator.url, timeout=5) as api:
        served = 0
        while not slow.done():
            await api.healthz()
            served += 1
            await asyncio.sleep(0.05)
    closed_after = await slow
    assert coordinator.proc is not None and coordinator.proc.poll() is None, coordinator.log_tail()
    assert closed_after is not None, "the slow client was never disconnected"
    assert closed_after < 3.0, f"disconnected only after {closed_after:.1f}s (bound {READ_TIMEOUT:g}s)"
    assert served >= 5


async def test_a_long_poll_is_not_cut_off_by_the_read_bound(shared: Shared) -> None:
    async with CoordinatorAPI(shared.coordinator.url, timeout=10) as api:
        index = (await api.recv_weight_meta(0, wait_timeout_s=0)).end_index  # where this test's entries start
        started = time.monotonic()
        batch = await api.recv_weight_meta(index, wait_timeout_s=2.5)  # answering may take long, reading may not
        assert batch.entries == [] and time.monotonic() - started >= 2.4
        await api.send_weight_meta(WeightMeta.end())  # the kept-alive connection still works


@pytest.mark.own_redis
async def test_300_concurrent_long_polls_all_answer_from_a_bounded_redis_pool(
    dcs_config: DCSConfig, redis_server: RedisServer, tmp_path: Path
) -> None:
    config = dcs_config.model_copy(update={"redis_max_connections": 32, "redis_pool_timeout_seconds": 10.0})
    coordinator = CoordinatorProcess(config, tmp_path / "coordinator.log").start()
    admin = redis_server.client()
    try:
        limits = httpx.Limits(max_connections=400, max_keepalive_connections=400)
        async with httpx.AsyncClient(base_url=coordinator.url, timeout=60, limits=limits) as http:
            await http.get("/health")

            async def poll() -> int:
                return (await http.get("/recv_weight_meta", params={"index": 0, "wait_timeout_s": 1})).status_code

            admin.execute_command("CLIENT", "PAUSE", "3000")  # Redis stalls (e.g. a slow command): reads pile up
            codes = await asyncio.wait_for(asyncio.gather(*[poll() for _ in range(300)]), 60)
            opened = int(admin.info("clients")["connected_clients"])  # a pool keeps what it opened
    finally:
        coordinator.stop()
    assert codes.count(200) == 300, {c: codes.count(c) for c in set(codes)}
    assert opened <= 32 + 2, f"{opened} Redis connections open (pool bound 32, + this test's)"


PASSWORD = "hunter2-redis-pass"
TOKEN = "tok-secret-value"


@pytest.fixture
def redis_with_password(tmp_path: Path) -> Iterator[int]:
    """A redis-server requiring a password (not PASSWORD) on a free port."""
    port = free_port()
    args = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen([*args, "--requirepass", "the-right-one"], stdout=subprocess.DEVNULL, cwd=tmp_path)
    try:
        wait_for_port(port, 10)
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


async def test_no_secret_in_answers_or_logs(dcs_config: DCSConfig, redis_with_password: int, tmp_path: Path) -> None:
    url = f"redis://default:{PASSWORD}@127.0.0.1:{redis_with_password}/0"  # refused (WRONGPASS): every call fails
    config = dcs_config.model_copy(update={"redis_url": url, "auth_token": SecretStr(TOKEN)})
    coordinator = CoordinatorProcess(config, tmp_path / "coordinator.log").start()
    try:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with httpx.AsyncClient(base_url=coordinator.url, timeout=20, headers=headers) as http:
            answers = [await http.get("/topology"), await http.post("/register", json={"role_name": "a"})]
        await asyncio.sleep(0.5)
    finally:
        coordinator.stop()
    assert [a.status_code for a in answers] == [503, 503], answers[0].text
    log = coordinator.log_path.read_text()
    assert "answered 503" in log  # the failure is logged...
    for text in [a.text for a in answers] + [log]:
        assert PASSWORD not in text and TOKEN not in text  # ...without the secrets


def test_dcs_config_masks_every_secret() -> None:
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(REPO),
        "DCS_REDIS_URL": f"redis://default:{PASSWORD}@redis.example:6379/0",
        "DCS_AUTH_TOKEN": TOKEN,
        "DCS_COORDINATOR_URL": f"http://user:{PASSWORD}x@coordinator.example:8000",
    }
    for args in (["config"], ["config", "--markdown"]):
        done = subprocess.run(
            [sys.executable, "-m", "dcs_tasks.cli.main", *args], capture_output=True, text=True, env=env, timeout=60
        )
        assert done.returncode == 0, done.stderr
        assert PASSWORD not in done.stdout and TOKEN not in done.stdout
    assert "redis://default:***@redis.example:6379/0" in done.stdout or args[-1] == "--markdown"
    bad = subprocess.run(  # a rejected setting is named on stderr, its value (which may hold a secret) is not
        [sys.executable, "-m", "dcs_tasks.cli.main", "config"],
        capture_output=True,
        text=True,
        env={**env, "DCS_REDIS_URL": f"http://default:{PASSWORD}@redis.example"},
        timeout=60,
    )
    assert bad.returncode == 2 and "redis_url" in bad.stderr and PASSWORD not in bad.stdout + bad.stderr


async def test_a_corrupt_record_in_redis_leaves_a_real_coordinator_answering(shared: Shared) -> None:
    from dcs_tasks.keys import Keys

    async with CoordinatorAPI(shared.coordinator.url, timeout=10) as api:
        await api.register(RoleInfo(role_name="actor", rank=0, port=1))
        await api.register(RoleInfo(role_name="rollout", rank=0, port=2))
        shared.database.client().hset(Keys(shared.config.redis.namespace).role_nodes("actor"), "1", "{not json")
        assert sorted((await api.topology()).nodes["actor"]) == [0]
        assert (await api.peer("actor", 0)).port == 2
        assert (await api.health()).unreadable_records == 1


def _answer_to_head(port: int, size: int) -> bytes:
    """The status line a server answers to a GET /healthz whose head is `size` bytes, sent in one write."""
    start, end = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: ", b"\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(start + b"a" * (size - len(start) - len(end)) + end)
        return sock.recv(4096).split(b"\r\n", 1)[0]


def test_request_heads_are_bounded_at_16_kib_as_documented(shared: Shared) -> None:
    """Issue 20, finding 10: a 64 KiB head sent at once was accepted by the coordinator (h11 bounds only a
    head still arriving). Now DCS_COORDINATOR_MAX_HEADER_BYTES (16 KiB) holds however it arrives: 431."""
    port = shared.coordinator.port
    assert shared.config.coordinator.max_header_bytes == 16 * 1024  # the default
    assert _answer_to_head(port, 16 * 1024) == b"HTTP/1.1 200 OK"
    assert _answer_to_head(port, 16 * 1024 + 1) == b"HTTP/1.1 431 Request Header Fields Too Large"
    assert _answer_to_head(port, 64 * 1024) == b"HTTP/1.1 431 Request Header Fields Too Large"
