"""`dcs engine attach` as a real process against a real `dcs coordinator` on a real redis-server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import SecretStr

from dcs_tasks.config import DCSConfig
from tests.helpers.ports import free_port
from tests.helpers.procs import CoordinatorProcess
from tests.integration.engine_attach_support import AttachProcess, rollout_nodes

pytestmark = [pytest.mark.integration, pytest.mark.slow]
TOKEN = "attach-test-token-5f1c"


@pytest.fixture
def config(dcs_config: DCSConfig) -> DCSConfig:
    return dcs_config.model_copy(update={"auth_token": SecretStr(TOKEN)})


@pytest.fixture
def coordinator(config: DCSConfig, tmp_path: Path) -> Iterator[CoordinatorProcess]:
    proc = CoordinatorProcess(config, tmp_path / "coordinator.log").start()
    yield proc
    proc.stop()


def test_an_engine_that_never_answers_health_is_a_named_error(
    config: DCSConfig, coordinator: CoordinatorProcess, tmp_path: Path
) -> None:
    engine_url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    attach = AttachProcess(config, tmp_path / "attach.log", coordinator.url, engine_url, rank=0)
    code = attach.start("--wait-timeout", "1.5").wait_exit(timeout=30)
    log = attach.log_tail()
    assert code == 1, log
    assert "EngineUnavailable" in log and engine_url in log
    assert rollout_nodes(coordinator.url, TOKEN) == {}
    assert TOKEN not in log
