"""Real `dcs worker` / `dcs coordinator` processes for integration tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import redis

from dcs_tasks.celery_app import node_queue
from dcs_tasks.config import DCSConfig
from dcs_tasks.keys import Keys
from dcs_tasks.redisconn import sync_client
from tests.helpers.ports import free_port, wait_for_port
from tests.helpers.preloaded import PreloadedProcess, python_module

REPO = Path(__file__).resolve().parents[2]


def child_env(config: DCSConfig, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DCS_")}
    env.update(config.to_env())
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


class DcsProcess:
    """`python -m dcs_tasks.cli.main ARGS` in its own session, logging to `log_path`."""

    module = "dcs_tasks.cli.main"  # what `python -m` runs: a test may run the CLI from a wrapper of its own

    def __init__(self, config: DCSConfig, log_path: Path) -> None:
        self.config = config
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | PreloadedProcess | None = None

    def spawn(self, *args: str, extra_env: dict[str, str] | None = None, preloaded: bool = False) -> None:
        """`preloaded`: fork it from the forkserver that already imported torch, Celery's worker, FastAPI and
        uvicorn (tests/helpers/preloaded.py): it starts in a fraction of the CPU a fresh interpreter takes. A `dcs
        worker` forked so re-execs itself as `python -m` (its restart after a crash)."""
        env = child_env(self.config, **(extra_env or {}))
        if preloaded:
            self.proc = python_module(self.module, *args, log=self.log_path, env=env)
            return
        cmd = [sys.executable, "-m", self.module, *args]
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO
        )

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (graceful), then kill -9 after `timeout`."""
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
        self.proc = None

    def kill(self) -> None:
        """kill -9 the whole process group (a worker's pool included)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)
        self.proc = None

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except FileNotFoundError:
            return ""


class WorkerProcess(DcsProcess):
    """`dcs worker`; ready once its presence key is in Redis."""

    def __init__(
        self,
        config: DCSConfig,
        log_path: Path,
        *,
        concurrency: int = 2,
        pool: str = "prefork",
        env: dict[str, str] | None = None,
        module: str | None = None,
        preloaded: bool = True,
    ) -> None:
        super().__init__(config, log_path)
        if module is not None:
            self.module = module
        self.concurrency = concurrency
        self.pool = pool
        self.extra_env = env or {}
        self.preloaded = preloaded

    def start(self, timeout: float = 60.0) -> WorkerProcess:
        """`preloaded` (the default): forked from the preloaded forkserver (a restart re-execs a real `python -m`);
        False: a fresh interpreter, `subprocess.Popen`, for a test that needs the worker's own command line in
        /proc (a forked one shows the forkserver's)."""
        args = ("worker", f"--concurrency={self.concurrency}", f"--pool={self.pool}", "--loglevel=INFO")
        self.spawn(*args, extra_env=self.extra_env, preloaded=self.preloaded)
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float) -> None:
        client = sync_client(self.config)  # a plain or a Sentinel URL
        key = Keys(self.config.redis.namespace).worker_presence(node_queue(self.config.host_name))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {self.proc.returncode}; log: {self.log_tail()}")
            try:
                if client.exists(key):
                    return
            except redis.RedisError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"worker not ready after {timeout}s; log: {self.log_tail()}")

    def child_pids(self) -> list[int]:
        """The prefork pool's child processes."""
        assert self.proc is not None
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True, check=False)
        return [int(p) for p in out.stdout.split()]

    def terminate(self, timeout: float = 30.0) -> None:
        """Warm shutdown (SIGTERM): running tasks finish or are restored."""
        self.stop(timeout)

    def discard(self) -> None:
        """Teardown of a worker whose shutdown the test does not look at: kill -9 of its process group, no
        warm shutdown (about 3 s of Celery closing its pool and consumer, per worker, saved). Only for a test's
        end: a task still running is cut, as when a host dies."""
        self.kill()


class CoordinatorProcess(DcsProcess):
    """`dcs coordinator` (uvicorn) on a free port."""

    def __init__(self, config: DCSConfig, log_path: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        update = {"coordinator_port": self.port, "coordinator_host": "127.0.0.1"}
        super().__init__(config.model_copy(update=update), log_path)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> CoordinatorProcess:
        self.spawn("coordinator", preloaded=True)
        wait_for_port(self.port, timeout)
        return self
