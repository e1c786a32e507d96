"""`dcs engine attach` against engines running SGLang's own HTTP server code (tests/sglang_engine: SGLang's
FastAPI app, API-key middleware, tokenizer manager and TP scheduler processes on CPU), with a real
`dcs coordinator` on a real redis-server. SGLang versions come from `.sglang/<version>` (`make sglang-engines`).
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import EngineIncompatible
from dcs_tasks.sync.engine_protocol import engine_info
from dcs_tasks.sync.wire import EngineEndpoint
from tests.helpers.procs import CoordinatorProcess
from tests.integration.engine_attach_support import (
    TOKEN,
    HealthSwitchEngine,
    rollout_nodes,
    sidecar,
    wait_for,
)
from tests.sglang_engine.harness import NEW, OLD, SGLangEngine, installed, warm

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _need(version: str) -> None:
    if not installed(version):
        pytest.skip(f"SGLang {version} is not installed under .sglang/ (make sglang-engines)")


@pytest.fixture(scope="module", autouse=True)
def _zygotes() -> None:
    warm(NEW, OLD)  # both versions' imports start at once (tests/sglang_engine/zygote.py)


def _registered(coordinator: CoordinatorProcess, rank: int) -> bool:
    return rank in rollout_nodes(coordinator.url, TOKEN)


def test_tp2_engine_is_registered_kept_alive_dropped_when_killed_back_when_restarted(
    config: DCSConfig, coordinator: CoordinatorProcess, tmp_path: Path
) -> None:
    _need(NEW)
    engine = SGLangEngine(NEW, tmp_path / "engine.log", tp=2, api_key=TOKEN).start()
    attach = sidecar(config, tmp_path / "attach.log", coordinator.url, engine.url, rank=1).start()
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
        wrong = sidecar(config, tmp_path / "wrong.log", coordinator.url, engine.url, rank=0)
        code = wrong.start("--engine-api-key", "not-the-engine-key").wait_exit(timeout=60)
        log = wrong.log_tail()
        assert code == 1, log
        assert "EngineAuthRefused" in log and "401" in log
        assert not _registered(coordinator, 0)
        assert TOKEN not in log

        right = sidecar(config, tmp_path / "right.log", coordinator.url, engine.url, rank=0).start()
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
        attach = sidecar(config, tmp_path / "attach.log", coordinator.url, stand_in.url, rank=0)
        code = attach.start().wait_exit(timeout=60)
    log = attach.log_tail()
    assert code == 1, log
    assert "EngineIncompatible" in log and "dp_size=2" in log
    assert not _registered(coordinator, 0)
    assert TOKEN not in log
