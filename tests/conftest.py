"""Shared fixtures: each test's Redis and a DCSConfig on it.

`redis_server` is a database of its own on a redis-server shared by the tests of this pytest process (started on
first use, AOF off); a test marked `@pytest.mark.own_redis` gets a private server it may stop, kill and restart
instead (AOF, appendfsync always)."""

from __future__ import annotations

import asyncio
import atexit
import itertools
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from dcs_tasks.config import DCSConfig
from tests.helpers.procs import WorkerProcess
from tests.helpers.redis_server import RedisDB, RedisServer
from tests.helpers.shm import shm_dir
from tests.helpers.testconfig import short_config

if TYPE_CHECKING:
    from dcs_tasks.checkpoint.inline import InlineCommitter
    from tests.checkpoint_support import Inline  # imports torch

# Database indexes of the shared server: one per test, never reused within a pytest process.
SHARED_DATABASES = 16384

# Files that `make test` runs in one process, one after another (whole files still, each in collection order):
# those that start engines from the same per-process forking server, which imports SGLang or vLLM once per pytest
# process (tests/sglang_engine/zygote.py, tests/vllm_engine/launcher.py: 15-25 s of CPU each on a 2-core machine).
# Spread over several processes, each process paid that import again.
SHARED_PROCESS = {
    **dict.fromkeys(
        (
            "tests/integration/test_sglang_engines.py",
            "tests/integration/engine_attach/test_engine_attach_sglang.py",
            "tests/integration/test_colocated_sglang.py",
            "tests/sglang_engine/test_protocol.py",
            "tests/sglang_engine/test_harness.py",
        ),
        "sglang zygote",
    ),
    **dict.fromkeys(
        ("tests/integration/test_vllm_engines.py", "tests/integration/test_colocated_vllm.py"), "vllm launcher"
    ),
}


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadfile` with the files of `SHARED_PROCESS` handed out as one unit per group, the units that took
    longest in a recorded run first (tests/helpers/schedule.py)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from tests.helpers.schedule import LongestFirst

    return LongestFirst(config, log, SHARED_PROCESS)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The units that took longest in a recorded run first (tests/helpers/schedule.py); the tests of one file
    keep their order."""
    from tests.helpers.schedule import load_seconds, order_items

    order_items(items, Path(str(config.rootpath)), SHARED_PROCESS, load_seconds())


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """An xdist worker, done (its results are with the controller, which waits for it to end), runs the exit
    handlers now and ends without the interpreter's teardown: with torch and the engines' libraries loaded that
    took 2-5 s per process at the end of a run, on a machine all four processes finish on at once."""
    if not hasattr(config, "workerinput"):
        return
    atexit._run_exitfuncs()  # what the interpreter's exit runs: engine launchers, forkservers, temp files
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# Seconds before pytest-timeout ends a test at which the stacks of the test's asyncio tasks are printed (to the
# test's captured stderr, shown with its failure). pytest-timeout prints the threads' stacks only, and an async
# test stuck on an await shows nothing but its event loop's select.
TASK_DUMP_LEAD_SECONDS = 20.0


def _dump_asyncio_tasks(signum: int, frame: object) -> None:
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return
    tasks = asyncio.all_tasks(loop)
    print(f"--- {len(tasks)} asyncio tasks, {TASK_DUMP_LEAD_SECONDS:g}s before the test's timeout ---", file=sys.stderr)
    for task in tasks:
        print(f"task {task.get_name()}:", file=sys.stderr)
        awaited: object = task.get_coro()
        for _ in range(64):  # the chain of awaits down to what the task waits on
            frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "gi_frame", None)
            if frame is None:
                print(f"  waits on {awaited!r}"[:500], file=sys.stderr)
                break
            print(f"  {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}", file=sys.stderr)
            awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "gi_yieldfrom", None)
            if awaited is None:
                break


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    """Shortly before the test's timeout, print its asyncio tasks' stacks (a SIGUSR2 to the main thread, whose
    handler runs while the event loop waits)."""
    marker = item.get_closest_marker("timeout")
    limit = float(marker.args[0]) if marker is not None and marker.args else float(item.config.getini("timeout") or 0)
    timer = None
    if limit > TASK_DUMP_LEAD_SECONDS and threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGUSR2, _dump_asyncio_tasks)
        main = threading.main_thread().ident
        assert main is not None
        timer = threading.Timer(limit - TASK_DUMP_LEAD_SECONDS, signal.pthread_kill, (main, signal.SIGUSR2))
        timer.daemon = True
        timer.start()
    try:
        yield
    finally:
        if timer is not None:
            timer.cancel()
            signal.signal(signal.SIGUSR2, previous)


@pytest.fixture(scope="session")
def shared_redis() -> Iterator[tuple[RedisServer, Iterator[int]]]:
    """The redis-server the tests of this pytest process share (one database each)."""
    workdir = Path(tempfile.mkdtemp(prefix="dcs-shared-redis-"))
    server = RedisServer(workdir, appendonly=False, databases=SHARED_DATABASES)
    server.start()
    yield server, itertools.count(1)
    server.stop()
    shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def redis_server(
    request: pytest.FixtureRequest, tmp_path: Path, shared_redis: tuple[RedisServer, Iterator[int]]
) -> Iterator[RedisServer | RedisDB]:
    if request.node.get_closest_marker("own_redis") is not None:
        server = RedisServer(tmp_path / "redis")
        server.start()
        yield server
        server.stop()
        return
    shared, indexes = shared_redis
    if shared.proc is None or shared.proc.poll() is not None:
        raise RuntimeError(f"the shared redis-server on port {shared.port} is gone; see {shared.workdir}/redis.log")
    database = RedisDB(shared, next(indexes))
    yield database
    database.flush()


@pytest.fixture
def dcs_config(redis_server: RedisServer, tmp_path: Path) -> DCSConfig:
    """A config on the private Redis, with short heartbeats and a private checkpoint dir."""
    return short_config(redis_server.url, tmp_path)


@pytest.fixture
def inline() -> Iterator[Inline]:
    """Makes in-process committers (`inline(config)`, for `Checkpointer(..., celery_app=...)`): what a `dcs worker`
    does for a save (persist, commit and what follows: retention, replicas, the memory tier), on this process's
    threads against the test's real Redis. For tests of checkpoint behaviour, not of the worker process; each is
    closed (its work drained) after the test."""
    from dcs_tasks.checkpoint.inline import InlineCommitter

    made: list[InlineCommitter] = []

    def make(config: DCSConfig) -> InlineCommitter:
        made.append(InlineCommitter(config))
        return made[-1]

    yield make
    for committer in made:
        committer.close()


@pytest.fixture
def worker(dcs_config: DCSConfig, tmp_path: Path) -> Iterator[WorkerProcess]:
    """One live `dcs worker` (prefork, 2 processes) serving node queue `dcs.node.testhost`."""
    proc = WorkerProcess(dcs_config, tmp_path / "worker.log").start()
    yield proc
    proc.discard()


@pytest.fixture(autouse=True)
def _keep_sigpipe_handling() -> Iterator[None]:
    """Tests that call `dcs_tasks.cli.main.main` in this process get SIGPIPE's default action set (as `dcs ckpt`
    wants); put back what this process had, or a later test in it dies silently on a write to a closed socket."""
    before = signal.getsignal(signal.SIGPIPE)
    yield
    signal.signal(signal.SIGPIPE, before)


@pytest.fixture(autouse=True)
def _remove_test_staging(tmp_path: Path) -> Iterator[None]:
    """Staging buffers of a test live in /dev/shm (tests.checkpoint_support.ckpt_config): free them after it."""
    yield
    shutil.rmtree(shm_dir(tmp_path), ignore_errors=True)
