"""`dcs engine attach` against engines running SGLang's own HTTP server code (tests/sglang_engine: SGLang's
FastAPI app, API-key middleware, tokenizer manager and TP scheduler processes on CPU), with a real
`dcs coordinator` on a real redis-server. SGLang versions come from `.sglang/<version>` (`make sglang-engines`).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from pydantic import SecretStr

from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import EngineIncompatible
from dcs_tasks.sync.engine_protocol import engine_info
from dcs_tasks.sync.wire import EngineEndpoint
from tests.helpers.procs import CoordinatorProcess
from tests.helpers.redis_server import RedisDB, RedisServer
from tests.helpers.testconfig import short_config
from tests.integration.engine_attach_support import AttachProcess, HealthSwitchEngine, rollout_nodes, wait_for
from tests.sglang_engine.harness import NEW, OLD, SGLangEngine, installed, warm

pytestmark = [pytest.mark.integration, pytest.mark.slow]
TOKEN = "attach-sglang-token-2b9e"


def _need(version: str) -> None:
    if not installed(version):
        pytest.skip(f"SGLang {version} is not installed under .sglang/ (make sglang-engines)")


@pytest.fixture(scope="module", autouse=True)
def _zygotes() -> None:
    warm(NEW, OLD)  # both versions' imports start at once (tests/sglang_engine/zygote.py)


@pytest.fixture(scope="module")
def module_config(
    shared_redis: tuple[RedisServer, Iterator[int]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DCSConfig]:
    """The module's config, as `dcs_config` makes a test's (a database of its own on the shared redis-server,
    short heartbeats), requiring TOKEN."""
    server, indexes = shared_redis
    database = RedisDB(server, next(indexes))
    tmp = tmp_path_factory.mktemp("attach-sglang")
    yield short_config(database.url, tmp, auth_token=SecretStr(TOKEN))
    database.flush()


@pytest.fixture(scope="module")
def module_coordinator(
    module_config: DCSConfig, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CoordinatorProcess]:
    """One `dcs coordinator` for the tests of this module (none of them looks at the coordinator process)."""
    proc = CoordinatorProcess(module_config, tmp_path_factory.mktemp("attach-sglang-coordinator") / "coordinator.log")
    yield proc.start()
    proc.stop()


@pytest.fixture
def config(module_config: DCSConfig) -> DCSConfig:
    return module_config


def _live_nodes(url: str) -> dict[str, dict[str, object]]:
    """Every live node `/topology` reports, by role."""
    answer = httpx.get(f"{url}/topology", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    answer.raise_for_status()
    return {role: nodes for role, nodes in answer.json()["nodes"].items() if nodes}


@pytest.fixture
def coordinator(module_coordinator: CoordinatorProcess) -> Iterator[CoordinatorProcess]:
    """The module's coordinator, holding no live node when the test starts and none after it (every test stops
    what it attached; a node killed without unregistering leaves when its heartbeat timeout runs out)."""
    assert module_coordinator.proc is not None and module_coordinator.proc.poll() is None, module_coordinator.log_tail()
    assert _live_nodes(module_coordinator.url) == {}
    yield module_coordinator
    wait_for("no live node left", lambda: _live_nodes(module_coordinator.url) == {}, timeout=30)


def _sidecar(config: DCSConfig, log_path: Path, coordinator_url: str, engine_url: str, rank: int) -> AttachProcess:
    """`dcs engine attach`, forked from the preloaded forkserver (no interpreter start and imports per sidecar)."""
    return AttachProcess(config, log_path, coordinator_url, engine_url, rank, preloaded=True)


def _registered(coordinator: CoordinatorProcess, rank: int) -> bool:
    return rank in rollout_nodes(coordinator.url, TOKEN)


def test_tp2_engine_is_registered_kept_alive_dropped_when_killed_back_when_restarted(
    config: DCSConfig, coordinator: CoordinatorProcess, tmp_path: Path
) -> None:
    _need(NEW)
    engine = SGLangEngine(NEW, tmp_path / "engine.log", tp=2, api_key=TOKEN).start()
    attach = _sidecar(config, tmp_path / "attach.log", coordinator.url, engine.url, rank=1).start()
    try:
        wait_for("rollout_1 registered", lambda: _registered(coordinator, 1), timeout=60)
        node = rollout_nodes(coordinator.url, TOKEN)[1]
        assert (node.ip, node.port) == ("127.0.0.1", engine.port)
        instance = node.metadata.pop("instance")  # a new token per registration (restarts: see planning.py)
        assert isinstance(instance, str) and len(instance) == 32
        assert node.metadata == {"engine": "sglang", "engine_version": NEW, "tp_size": 2, "num_gpus": 2}
        time.sleep(2 * config.heartbeat.timeout_seconds)  # alive only because the sidecar keeps beating
        assert _registered(coordinator, 1)

        engine.stop()  # kill -9 of the server and its scheduler processes
        gone = wait_for("rollout_1 gone", lambda: not _registered(coordinator, 1), timeout=30, poll=0.05)
        bound = config.heartbeat.timeout_seconds + config.heartbeat.interval_seconds
        assert gone <= bound + 0.5, f"gone {gone:.2f}s after the kill; bound {bound}s (+0.5 s polling slack)"

        engine = SGLangEngine(NEW, tmp_path / "engine.log", tp=2, api_key=TOKEN, port=engine.port).start()
        wait_for("rollout_1 registered again", lambda: _registered(coordinator, 1), timeout=60)
        assert attach.running()

        assert attach.proc is not None
        attach.proc.send_signal(signal.SIGTERM)
        assert attach.wait_exit(timeout=15) == 0
        assert not _registered(coordinator, 1)  # unregistered, not left to expire (read at once)
    finally:
        attach.kill()
        engine.stop()
    log = attach.log_tail(100_000)
    assert log.count(f"registered SGLang {NEW} engine") == 2 and "unregistered rollout_1" in log
    assert TOKEN not in log


def test_wrong_api_key_is_refused_by_name_and_the_right_one_attaches_the_older_version(
    config: DCSConfig, coordinator: CoordinatorProcess, tmp_path: Path
) -> None:
    _need(OLD)
    engine = SGLangEngine(OLD, tmp_path / "engine.log", tp=1, api_key=TOKEN).start()
    try:
        wrong = _sidecar(config, tmp_path / "wrong.log", coordinator.url, engine.url, rank=0)
        code = wrong.start("--engine-api-key", "not-the-engine-key").wait_exit(timeout=60)
        log = wrong.log_tail()
        assert code == 1, log
        assert "EngineAuthRefused" in log and "401" in log
        assert not _registered(coordinator, 0)
        assert TOKEN not in log

        right = _sidecar(config, tmp_path / "right.log", coordinator.url, engine.url, rank=0).start()
        try:
            wait_for("rollout_0 registered", lambda: _registered(coordinator, 0), timeout=60)
            assert rollout_nodes(coordinator.url, TOKEN)[0].metadata["engine_version"] == OLD
        finally:
            right.stop()
        assert TOKEN not in right.log_tail(100_000)
    finally:
        engine.stop()


def test_data_parallel_engine_is_refused_on_sglangs_own_server_info(
    config: DCSConfig, coordinator: CoordinatorProcess, tmp_path: Path
) -> None:
    """The harness runs one scheduler per TP rank and no DP controller, so SGLang's real `/server_info` answer
    is read from a TP=1 engine and served with dp_size=2 by a stand-in, to the real sidecar."""
    _need(NEW)
    engine = SGLangEngine(NEW, tmp_path / "engine.log", tp=1, api_key=TOKEN).start()
    try:
        real = engine.get("/server_info").json()
    finally:
        engine.stop()
    assert real["version"] == NEW and real["dp_size"] == 1 and real["tp_size"] == 1
    assert real["api_key"] == TOKEN  # SGLang's answer carries the key: the sidecar must never log it
    endpoint = EngineEndpoint(rank=0, ip="127.0.0.1", port=1)
    assert engine_info(endpoint, real).tp_size == 1
    with pytest.raises(EngineIncompatible, match="dp_size=2"):
        engine_info(endpoint, {**real, "dp_size": 2})

    with HealthSwitchEngine({**real, "dp_size": 2}) as stand_in:
        attach = _sidecar(config, tmp_path / "attach.log", coordinator.url, stand_in.url, rank=0)
        code = attach.start().wait_exit(timeout=60)
    log = attach.log_tail()
    assert code == 1, log
    assert "EngineIncompatible" in log and "dp_size=2" in log
    assert not _registered(coordinator, 0)
    assert TOKEN not in log
