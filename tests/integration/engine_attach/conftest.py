"""The fixtures of the `dcs engine attach` tests (this folder): one `dcs coordinator` per test module on a Redis
database of the module's own, requiring `engine_attach_support.TOKEN`, holding no live node between tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pydantic import SecretStr

from dcs_tasks.config import DCSConfig
from tests.helpers.procs import CoordinatorProcess
from tests.helpers.redis_server import RedisDB, RedisServer
from tests.helpers.testconfig import short_config
from tests.integration.engine_attach_support import TOKEN, live_nodes, wait_for


@pytest.fixture(scope="module")
def module_config(
    shared_redis: tuple[RedisServer, Iterator[int]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DCSConfig]:
    """The module's config, as `dcs_config` makes a test's (a database of its own on the shared redis-server,
    short heartbeats), requiring TOKEN."""
    server, indexes = shared_redis
    database = RedisDB(server, next(indexes))
    yield short_config(database.url, tmp_path_factory.mktemp("attach"), auth_token=SecretStr(TOKEN))
    database.flush()


@pytest.fixture(scope="module")
def module_coordinator(
    module_config: DCSConfig, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CoordinatorProcess]:
    """One `dcs coordinator` for the tests of a module (none of them looks at the coordinator process)."""
    proc = CoordinatorProcess(module_config, tmp_path_factory.mktemp("attach-coordinator") / "coordinator.log")
    yield proc.start()
    proc.stop()


@pytest.fixture
def config(module_config: DCSConfig) -> DCSConfig:
    return module_config


@pytest.fixture
def coordinator(module_coordinator: CoordinatorProcess) -> Iterator[CoordinatorProcess]:
    """The module's coordinator, holding no live node when the test starts and none after it (every test stops
    what it attached; a node killed without unregistering leaves when its heartbeat timeout runs out)."""
    assert module_coordinator.proc is not None and module_coordinator.proc.poll() is None, module_coordinator.log_tail()
    assert live_nodes(module_coordinator.url) == {}
    yield module_coordinator
    wait_for("no live node left", lambda: live_nodes(module_coordinator.url) == {}, timeout=30)
