"""Shared fixtures: a private redis-server per test (function scope, restartable) and a DCSConfig on it."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from dcs_tasks.config import DCSConfig
from tests.helpers.procs import WorkerProcess
from tests.helpers.redis_server import RedisServer


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def dcs_config(redis_server: RedisServer, tmp_path: Path) -> DCSConfig:
    """A config on the private Redis, with short heartbeats and a private checkpoint dir."""
    return DCSConfig(
        redis_url=redis_server.url,
        checkpoint_dir=tmp_path / "ckpt",
        heartbeat_interval_seconds=0.5,
        heartbeat_timeout_seconds=2.0,
        node_name="testhost",
        enable_metrics=False,
    )


@pytest.fixture
def worker(dcs_config: DCSConfig, tmp_path: Path) -> Iterator[WorkerProcess]:
    """One live `dcs worker` (prefork, 2 processes) serving node queue `dcs.node.testhost`."""
    proc = WorkerProcess(dcs_config, tmp_path / "worker.log").start()
    yield proc
    proc.terminate()


@pytest.fixture(autouse=True)
def _remove_test_staging(tmp_path: Path) -> Iterator[None]:
    """Staging buffers of a test live in /dev/shm (tests.checkpoint_support.ckpt_config): free them after it."""
    yield
    shutil.rmtree(Path("/dev/shm") / f"dcs-test-{tmp_path.name}", ignore_errors=True)
