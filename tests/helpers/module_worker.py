"""One `dcs worker` for a whole test module, for modules whose tests neither look at the worker process nor need a
fresh one: a module fixture opens `module_worker(...)` and yields what it gives.

    @pytest.fixture(scope="module")
    def served(shared_redis, tmp_path_factory) -> Iterator[ModuleWorker]:
        with module_worker(shared_redis, tmp_path_factory, "trust", prepare=ckpt_config) as served:
            yield served

The module gets a Redis database of its own on the shared redis-server and a checkpoint directory of its own, as
the `dcs_config` fixture (tests/conftest.py) makes a test's (short heartbeats, node "testhost", no metrics);
`prepare(config, tmp)` may change the config before the worker starts (e.g. `tests.checkpoint_support.ckpt_config`).
After the last test the worker is discarded, the database flushed and the module's /dev/shm staging removed. Tests
of one module share the root, so each saves runs of its own names.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from dcs_tasks.config import DCSConfig
from tests.helpers.procs import WorkerProcess
from tests.helpers.redis_server import RedisDB, RedisServer
from tests.helpers.shm import shm_dir
from tests.helpers.testconfig import short_config


@dataclass(frozen=True)
class ModuleWorker:
    config: DCSConfig
    worker: WorkerProcess
    tmp: Path  # the module's directory (checkpoint root, worker log)


@contextmanager
def module_worker(
    shared_redis: tuple[RedisServer, Iterator[int]],
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    prepare: Callable[[DCSConfig, Path], DCSConfig] | None = None,
    concurrency: int = 2,
) -> Iterator[ModuleWorker]:
    server, indexes = shared_redis
    database = RedisDB(server, next(indexes))
    tmp = tmp_path_factory.mktemp(name)
    config = short_config(database.url, tmp)
    if prepare is not None:
        config = prepare(config, tmp)
    worker = WorkerProcess(config, tmp / "worker.log", concurrency=concurrency)
    try:
        yield ModuleWorker(config, worker.start(), tmp)
    finally:
        worker.discard()  # also one that did not get ready
        database.flush()
        shutil.rmtree(shm_dir(tmp), ignore_errors=True)
