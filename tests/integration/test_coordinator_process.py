"""Real `dcs coordinator` processes (uvicorn): statelessness, restarts of the coordinator and of Redis."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from dcs_tasks.config import DCSConfig, RoleInfo
from dcs_tasks.coordinator_api import CoordinatorAPI
from dcs_tasks.heartbeats import HeartbeatLoop
from dcs_tasks.models import WeightMeta
from tests.helpers.procs import CoordinatorProcess
from tests.helpers.redis_server import RedisServer
from tests.helpers.waiting import eventually

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture
def coordinator(dcs_config: DCSConfig, tmp_path: Path) -> Iterator[CoordinatorProcess]:
    proc = CoordinatorProcess(dcs_config, tmp_path / "coordinator-a.log").start()
    yield proc
    proc.stop()


def _non_loopback_ip() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("192.0.2.1", 9))  # no packet is sent; picks the outbound interface
            ip = str(sock.getsockname()[0])
        except OSError:
            return None
    return None if ip.startswith("127.") else ip


async def test_real_process_serves_the_api_on_loopback_only(coordinator: CoordinatorProcess) -> None:
    async with CoordinatorAPI(coordinator.url, timeout=10) as api:
        assert (await api.healthz()).status.value == "ok"
        registered = await api.register(RoleInfo(role_name="actor", port=4000))
        assert registered.node_id == "actor_0"
        assert (await api.node("actor", 0)).port == 4000
    ip = _non_loopback_ip()
    if ip is not None:  # the default bind is 127.0.0.1: another interface must refuse
        with pytest.raises(OSError), socket.create_connection((ip, coordinator.port), timeout=1):
            pass


@pytest.mark.own_redis
async def test_two_coordinators_on_one_redis_answer_alike(
    dcs_config: DCSConfig, coordinator: CoordinatorProcess, tmp_path: Path
) -> None:
    other = CoordinatorProcess(dcs_config, tmp_path / "coordinator-b.log").start()
    try:
        async with CoordinatorAPI(coordinator.url) as a, CoordinatorAPI(other.url) as b:
            answers = await asyncio.gather(
                *[(a if i % 2 else b).register(RoleInfo(role_name="rollout", port=9000 + i)) for i in range(20)]
            )
            assert sorted(r.rank for r in answers) == list(range(20))
            assert await a.topology() == await b.topology()
            assert await a.global_rank("rollout", 7) == await b.global_rank("rollout", 7) == 7
            client = redis.Redis.from_url(dcs_config.redis.url)
            client.config_resetstat()
            waiter = asyncio.create_task(b.recv_weight_meta(0, wait_timeout_s=10))
            await eventually(lambda: _script_calls(client) >= 1, 15, "B's first (empty) read")  # B now waits
            client.close()
            await a.send_weight_meta(WeightMeta.end())  # appended through A, wakes the long-poll on B
            assert (await asyncio.wait_for(waiter, 5)).entries == [WeightMeta.end()]
    finally:
        other.stop()


async def test_coordinator_restart_loses_nothing(dcs_config: DCSConfig, tmp_path: Path) -> None:
    # heartbeats must outlive the restart (seconds on a loaded machine); the fixture's 2 s TTL would not
    config = dcs_config.model_copy(update={"heartbeat_interval_seconds": 5.0, "heartbeat_timeout_seconds": 120.0})
    coordinator = CoordinatorProcess(config, tmp_path / "coordinator-restart.log").start()
    try:
        await _restart_and_compare(coordinator)
    finally:
        coordinator.stop()


async def _restart_and_compare(coordinator: CoordinatorProcess) -> None:
    async with CoordinatorAPI(coordinator.url) as api:
        await api.register(RoleInfo(role_name="actor", rank=0, port=1))
        await api.register(RoleInfo(role_name="rollout", rank=0, port=2))
        await api.send_weight_meta(WeightMeta(names=["w"], dtypes=["float32"], shapes=[[2]], group_name="g"))
        before = await api.topology()
    coordinator.stop()
    coordinator.start()
    async with CoordinatorAPI(coordinator.url) as api:
        assert await api.topology() == before
        assert len((await api.recv_weight_meta(0)).entries) == 1
        assert (await api.register(RoleInfo(role_name="actor", port=1))).rank == 0


@pytest.mark.own_redis
async def test_redis_restart_keeps_topology_and_ranks(
    dcs_config: DCSConfig, redis_server: RedisServer, tmp_path: Path
) -> None:
    config = dcs_config.model_copy(update={"heartbeat_interval_seconds": 5.0, "heartbeat_timeout_seconds": 120.0})
    coordinator = CoordinatorProcess(config, tmp_path / "coordinator-redis-restart.log").start()
    try:
        await _restart_redis_and_compare(coordinator, redis_server)
    finally:
        coordinator.stop()


async def _restart_redis_and_compare(coordinator: CoordinatorProcess, redis_server: RedisServer) -> None:
    async with CoordinatorAPI(coordinator.url) as api:
        for i in range(3):
            await api.register(RoleInfo(role_name="actor", port=100 + i))
        before = await api.topology()
        redis_server.restart()  # graceful: AOF flushed, heartbeat TTLs kept as absolute expiry times
        assert await api.topology() == before
        await api.heartbeat("actor", 2)
        assert (await api.register(RoleInfo(role_name="actor", port=101))).rank == 1
        assert (await api.register(RoleInfo(role_name="actor", port=200))).rank == 3


async def test_heartbeat_loop_keeps_a_node_alive_until_stopped(dcs_config: DCSConfig, tmp_path: Path) -> None:
    # a TTL of 1.5 s: beats 0.2 s apart leave room for a loaded machine's pauses
    config = dcs_config.model_copy(update={"heartbeat_interval_seconds": 0.2, "heartbeat_timeout_seconds": 1.5})
    proc = CoordinatorProcess(config, tmp_path / "coordinator-hb.log").start()
    try:
        async with CoordinatorAPI(proc.url) as api:
            reg = await api.register(RoleInfo(role_name="actor", port=1))
            loop = HeartbeatLoop(api, RoleInfo(role_name="actor", rank=reg.rank, port=1), interval=0.2).start()
            await asyncio.sleep(3.0)  # two TTLs
            assert (await api.health()).dead_nodes == []
            await loop.stop()
            assert loop.beats >= 5 and loop.failures == 0
            dead = await eventually(lambda: _dead_nodes(api), 15, "actor_0's TTL to run out once the loop stopped")
            assert dead == ["actor_0"]
    finally:
        proc.stop()


async def test_role_mappings_and_order_come_from_dcs_env(dcs_config: DCSConfig, tmp_path: Path) -> None:
    config = dcs_config.model_copy(update={"role_mappings": {"trainer": "engine"}, "role_order": ["engine", "trainer"]})
    proc = CoordinatorProcess(config, tmp_path / "coordinator-env.log").start()  # settings travel as DCS_* env
    try:
        async with CoordinatorAPI(proc.url) as api:
            await api.register(RoleInfo(role_name="trainer", rank=0, port=1))
            await api.register(RoleInfo(role_name="engine", rank=0, port=2))
            await api.register(RoleInfo(role_name="engine", rank=1, port=3))
            assert (await api.peer("trainer", 0)).port == 2
            assert await api.global_rank("trainer", 0) == 2
            assert (await api.debug_topology()).roles == ["engine", "trainer"]
    finally:
        proc.stop()


WRITER = """
from dcs_tasks.metrics import get_metrics
get_metrics().record_send(bytes_sent=100, duration=0.01)
"""


async def test_metrics_aggregate_every_process_in_multiprocess_mode(
    dcs_config: DCSConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import subprocess
    import sys

    from prometheus_client.parser import text_string_to_metric_families

    mp_dir = tmp_path / "prom"
    mp_dir.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(mp_dir))  # inherited by the processes started below
    for _ in range(2):  # two other DCS processes of this host (e.g. worker children)
        subprocess.run([sys.executable, "-c", WRITER], check=True, timeout=60, cwd=Path(__file__).parents[2])
    proc = CoordinatorProcess(dcs_config, tmp_path / "coordinator-mp.log").start()
    try:
        async with CoordinatorAPI(proc.url) as api, httpx.AsyncClient(base_url=proc.url, timeout=10) as http:
            await api.healthz()
            text = (await http.get("/metrics")).text
    finally:
        proc.stop()
    assert "dcs_bytes_sent_total 200.0" in text  # the other processes' samples, summed
    assert 'dcs_coordinator_requests_total{method="GET",route="/healthz",status="200"} 1.0' in text
    names = [family.name for family in text_string_to_metric_families(text)]
    assert len(names) == len(set(names))


async def test_an_unexpected_failure_answers_500_as_json_naming_it_without_secrets(dcs_config: DCSConfig) -> None:
    """A bug in a route is a JSON 500 naming it (the traceback goes to the log), secrets masked."""
    from pydantic import SecretStr

    from coordinator.app import create_app

    config = dcs_config.model_copy(update={"auth_token": SecretStr("tok-in-a-bug")})
    app = create_app(config)

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError(f"failed with {config.redis.url.replace('//', '//u:pw-in-url@')} and tok-in-a-bug")

    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport, base_url="http://c") as http:
        response = await http.get("/boom", headers={"Authorization": "Bearer tok-in-a-bug"})
    assert response.status_code == 500
    assert response.headers["content-type"] == "application/json"
    detail = response.json()["detail"]
    assert "GET /boom" in detail and "RuntimeError" in detail
    assert "pw-in-url" not in detail and "tok-in-a-bug" not in detail and "u:***@" in detail


async def _dead_nodes(api: CoordinatorAPI) -> list[str]:
    return (await api.health()).dead_nodes


def _script_calls(client: redis.Redis) -> int:
    """EVALSHA calls the server counted since the last CONFIG RESETSTAT (a weight-meta read is one)."""
    return int(client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))
