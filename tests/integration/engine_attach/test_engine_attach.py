"""`dcs engine attach` as a real process against a real `dcs coordinator` on a real redis-server."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from pydantic import SecretStr

from dcs_tasks.config import DCSConfig
from tests.helpers.procs import CoordinatorProcess
from tests.integration.engine_attach_support import (
    TOKEN,
    HealthSwitchEngine,
    ReceiverEngine,
    rollout_nodes,
    sidecar,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture
def receiver(config: DCSConfig, coordinator: CoordinatorProcess, tmp_path: Path) -> Iterator[ReceiverEngine]:
    proc = ReceiverEngine(config, tmp_path / "receiver.log", coordinator.url).start()
    yield proc
    proc.stop()


def _attached_at(url: str, rank: int, port: int) -> Callable[[], bool]:
    return lambda: (node := rollout_nodes(url, TOKEN).get(rank)) is not None and node.port == port


def _attached(coordinator: CoordinatorProcess, rank: int, port: int) -> Callable[[], bool]:
    return _attached_at(coordinator.url, rank, port)


def test_attach_registers_heartbeats_and_unregisters_on_sigterm(
    config: DCSConfig, coordinator: CoordinatorProcess, receiver: ReceiverEngine, tmp_path: Path
) -> None:
    attach = sidecar(config, tmp_path / "attach.log", coordinator.url, receiver.url, rank=3).start()
    try:
        wait_for("rollout_3 registered", _attached(coordinator, 3, receiver.port), timeout=30)
        node = rollout_nodes(coordinator.url, TOKEN)[3]
        assert (node.ip, node.port) == ("127.0.0.1", receiver.port)
        assert node.metadata["tp_size"] == 1 and node.metadata["engine_version"] == "0.5.23"
        time.sleep(2 * config.heartbeat.timeout_seconds)  # alive only if the sidecar keeps beating
        assert 3 in rollout_nodes(coordinator.url, TOKEN)
        attach.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        assert attach.wait_exit(timeout=15) == 0
        # unregistered at once, not left to expire: read before one heartbeat timeout could pass
        assert 3 not in rollout_nodes(coordinator.url, TOKEN)
    finally:
        attach.kill()
    log = attach.log_tail(100_000)
    assert "registered SGLang 0.5.23 engine" in log and "unregistered rollout_3" in log
    assert TOKEN not in log


def test_a_dead_engine_leaves_the_topology_and_is_registered_again_when_back(
    config: DCSConfig, coordinator: CoordinatorProcess, receiver: ReceiverEngine, tmp_path: Path
) -> None:
    attach = sidecar(config, tmp_path / "attach.log", coordinator.url, receiver.url, rank=0).start()
    try:
        wait_for("rollout_0 registered", _attached(coordinator, 0, receiver.port), timeout=30)
        receiver.kill()
        gone_after = wait_for("rollout_0 gone", lambda: 0 not in rollout_nodes(coordinator.url, TOKEN), 30, 0.05)
        bound = config.heartbeat.timeout_seconds + config.heartbeat.interval_seconds
        assert gone_after <= bound + 0.5, f"gone after {gone_after:.2f}s, bound {bound}s (+0.5 s polling slack)"
        # the attach unregisters once /health has failed for --down-after (the heartbeat timeout), counted from
        # its first failed probe: up to one interval after the topology dropped the node. An engine back before
        # that only gets its heartbeats again (same registration); this test is about the registration anew
        wait_for("the attach unregistered rollout_0", lambda: "unregistered rollout_0" in attach.log_tail(100_000), 30)
        receiver.start()  # same port
        wait_for("rollout_0 registered again", _attached(coordinator, 0, receiver.port), timeout=30)
        assert attach.running()
    finally:
        attach.stop()
    assert attach.log_tail(100_000).count("registered SGLang 0.5.23 engine") == 2


def test_an_engine_back_before_down_after_is_registered_anew_with_a_new_instance(
    config: DCSConfig, coordinator: CoordinatorProcess, receiver: ReceiverEngine, tmp_path: Path
) -> None:
    """An engine restarted at its address within --down-after (a supervisor's restart) is a new process that
    knows no update group: the sidecar registers it anew with a new `instance` token as soon as it answers,
    so that trainers rebuild their group for it instead of failing their next update."""
    # --down-after far longer than a restart takes on a loaded machine (with the default, the heartbeat timeout,
    # a restart slower than 2 s got the engine unregistered, and the test failed)
    attach = sidecar(config, tmp_path / "attach.log", coordinator.url, receiver.url, rank=0)
    attach.start("--down-after", "120")
    try:
        wait_for("rollout_0 registered", _attached(coordinator, 0, receiver.port), timeout=30)
        first = rollout_nodes(coordinator.url, TOKEN)[0].metadata["instance"]
        assert isinstance(first, str) and len(first) == 32
        receiver.kill()
        wait_for("a probe unanswered", lambda: "heartbeats paused" in attach.log_tail(100_000), 30, 0.05)
        receiver.start()  # same port, long before --down-after runs out
        wait_for(
            "rollout_0 registered with a new instance",
            lambda: (
                (node := rollout_nodes(coordinator.url, TOKEN).get(0)) is not None
                and node.port == receiver.port
                and node.metadata.get("instance") not in (None, first)
            ),
            timeout=30,
        )
        assert attach.running()
    finally:
        attach.stop()
    log = attach.log_tail(100_000)
    assert "registering it anew (it may have restarted)" in log
    assert log.count("registered SGLang 0.5.23 engine") == 2
    assert "has failed for" not in log  # never unregistered for being down


@pytest.mark.parametrize(
    ("wrong", "error"),
    [("engine_api_key", "EngineAuthRefused"), ("coordinator_token", "AuthError")],
    ids=["engine-api-key", "coordinator-token"],
)
def test_a_wrong_credential_is_a_named_error(
    config: DCSConfig,
    coordinator: CoordinatorProcess,
    receiver: ReceiverEngine,
    tmp_path: Path,
    wrong: str,
    error: str,
) -> None:
    """A wrong engine API key or coordinator token: the sidecar exits 1 naming the refusal (401), registers
    nothing, and prints neither secret."""
    secret = f"not-the-{wrong.replace('_', '-')}"
    engine_key = secret if wrong == "engine_api_key" else TOKEN
    if wrong == "coordinator_token":
        config = config.model_copy(update={"auth_token": SecretStr(secret)})
    attach = sidecar(config, tmp_path / "attach.log", coordinator.url, receiver.url, rank=0)
    code = attach.start(env={"DCS_ENGINE_API_KEY": engine_key}).wait_exit(timeout=30)
    log = attach.log_tail()
    assert code == 1, log
    assert error in log and "401" in log
    assert rollout_nodes(coordinator.url, TOKEN) == {}
    assert secret not in log and TOKEN not in log


def test_an_engine_answering_503_keeps_its_heartbeats_until_unhealthy_after(
    config: DCSConfig, coordinator: CoordinatorProcess, tmp_path: Path
) -> None:
    server_info = {"version": "0.5.23", "tp_size": 1, "dp_size": 1, "pp_size": 1}
    with HealthSwitchEngine(server_info) as engine:
        attach = sidecar(config, tmp_path / "attach.log", coordinator.url, engine.url, rank=0)
        attach.start("--unhealthy-after", "5")
        try:
            wait_for("rollout_0 registered", _attached(coordinator, 0, engine.port), timeout=30)
            engine.health_status = 503
            time.sleep(config.heartbeat.timeout_seconds + 2 * config.heartbeat.interval_seconds)
            assert 0 in rollout_nodes(coordinator.url, TOKEN)  # still beating: the engine answers
            wait_for("rollout_0 unregistered", lambda: 0 not in rollout_nodes(coordinator.url, TOKEN), timeout=5)
            engine.health_status = 200
            wait_for("rollout_0 registered again", _attached(coordinator, 0, engine.port), timeout=30)
        finally:
            attach.stop()
    assert "answered 503" in attach.log_tail(100_000)


def test_a_sidecar_whose_rank_a_live_engine_holds_is_refused_and_takes_nothing(
    config: DCSConfig, coordinator: CoordinatorProcess, receiver: ReceiverEngine, tmp_path: Path
) -> None:
    """A second engine attached at the rank of a live one: the coordinator refuses to hand the rank over
    (issue 20, finding 11; it used to take it, and the first sidecar then stopped), so the second sidecar
    stops with RankConflict and the first keeps its rank and its beats."""
    other = ReceiverEngine(config, tmp_path / "other.log", coordinator.url, self_role="engine-other").start()
    first = sidecar(config, tmp_path / "first.log", coordinator.url, receiver.url, rank=0).start()
    second = sidecar(config, tmp_path / "second.log", coordinator.url, other.url, rank=0)
    try:
        wait_for("rollout_0 is the first engine", _attached(coordinator, 0, receiver.port), timeout=30)
        second.start()
        assert second.wait_exit(timeout=30) == 1
        assert "RankConflict" in second.log_tail()
        time.sleep(2 * config.heartbeat.timeout_seconds)  # the first one keeps beating
        assert first.running() and rollout_nodes(coordinator.url, TOKEN)[0].port == receiver.port
    finally:
        first.stop()
        second.stop()
        other.stop()


def test_the_sidecar_waits_for_a_coordinator_that_is_not_up_yet(dcs_config: DCSConfig, tmp_path: Path) -> None:
    config = dcs_config.model_copy(update={"auth_token": SecretStr(TOKEN)})  # a database of its own
    server_info = {"version": "0.5.23", "tp_size": 1, "dp_size": 1, "pp_size": 1}
    late = CoordinatorProcess(config, tmp_path / "coordinator.log")  # port chosen, nothing listens yet
    with HealthSwitchEngine(server_info) as engine:
        attach = sidecar(config, tmp_path / "attach.log", late.url, engine.url, rank=2).start()
        try:
            time.sleep(2.0)
            assert attach.running()
            late.start()
            wait_for("rollout_2 registered", _attached_at(late.url, 2, engine.port), timeout=30)
        finally:
            attach.stop()
            late.stop()
    log = attach.log_tail(100_000)  # the client's own bounded retries may absorb the wait, or the sidecar's loop
    assert "Traceback" not in log and " as rollout_2 at " in log, log
