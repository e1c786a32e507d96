"""`LocalStack`: the whole DCS deployment on one machine, as real processes, for `dcs up` and `dcs demo`.

Started in order, each waited for with a bound: a private `redis-server` on a free port (password-protected,
AOF on; skipped when `DCS_REDIS_URL` is set), `dcs coordinator`, `dcs worker` (thread pool: weight-sync
tasks block on a rendezvous), N `dcs receiver` rollout engines and Flower (when installed and asked for).
One bearer token is generated per stack (unless `DCS_AUTH_TOKEN` is set) and reaches the children only
through their environment, never their command line. `stop()` ends them in reverse order; it also runs at
interpreter exit, and every child dies with its parent (see `dcs_tasks.local.procs`).
"""

from __future__ import annotations

import atexit
import fcntl
import functools
import os
import secrets
import shutil
import sys
import threading
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import httpx
from pydantic import SecretStr

from dcs_tasks.config import DCSConfig
from dcs_tasks.local.ports import free_port
from dcs_tasks.local.procs import (
    LocalStackError,
    Service,
    child_environ,
    interrupts_deferred,
)

LOOPBACK = "127.0.0.1"
REDIS_CHECK_SECONDS = 3.0  # how long `dcs up` waits for a given DCS_REDIS_URL to answer PING


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path` readable by this user only (0600, also when the file existed before)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode())
    finally:
        os.close(fd)


class LocalRedis:
    """A private redis-server on 127.0.0.1 with a generated password (in a 0600 config file, so it shows in
    no process list), AOF on with fsync always, no eviction."""

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise LocalStackError("redis-server is not installed (apt-get install redis-server), or set DCS_REDIS_URL")
        self.workdir = workdir
        self.port = port or free_port()
        self.password = secrets.token_urlsafe(24)
        self.binary = binary
        self.service: Service | None = None

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@{LOOPBACK}:{self.port}/0"

    def start(self, timeout: float) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True, mode=0o700)
        conf = self.workdir / "redis.conf"
        lines = [
            f"port {self.port}",
            f"bind {LOOPBACK}",
            "protected-mode yes",
            f"requirepass {self.password}",
            f'dir "{self.workdir.resolve()}"',
            "appendonly yes",
            "appendfsync always",
            'save ""',
            "maxmemory-policy noeviction",
            f'logfile "{(self.workdir / "redis.log").resolve()}"',
        ]
        write_private(conf, "\n".join(lines) + "\n")
        env = {k: v for k, v in os.environ.items() if not k.startswith("DCS_")}
        self.service = Service("redis-server", [self.binary, str(conf)], env, self.workdir / "stdout.log").start()
        self.service.wait_until(self._ping, timeout, f"PING on port {self.port}")

    def _ping(self) -> bool:
        import redis

        client = redis.Redis(host=LOOPBACK, port=self.port, password=self.password, socket_timeout=1)
        try:
            return bool(client.ping())
        finally:
            client.close()

    def stop(self) -> None:
        if self.service is not None:
            self.service.stop()


class LocalStack:
    """Start with `start()` or `with LocalStack(...) as stack:`; `stack.config` is what a trainer uses
    (`stack.env()` as environment variables). Not thread-safe except `stop()`, which may run twice."""

    def __init__(
        self,
        config: DCSConfig | None = None,
        *,
        workdir: Path,
        private_redis: bool | None = None,
        receivers: int = 0,
        flower: bool | None = False,
        coordinator_port: int = 0,
        flower_port: int = 0,
        worker_concurrency: int = 8,
        timeout: float = 90.0,
    ) -> None:
        """`private_redis` None: start one unless `DCS_REDIS_URL` is set. `flower` None: when installed.
        Ports 0: free ones. `timeout`: the bound on each process becoming ready."""
        if receivers < 0 or worker_concurrency < 1 or timeout <= 0:
            raise LocalStackError("receivers must be >= 0, worker_concurrency >= 1 and timeout > 0")
        self.workdir = workdir.resolve()
        self.logs = self.workdir / "logs"
        self.private_redis = "DCS_REDIS_URL" not in os.environ if private_redis is None else private_redis
        self.want_flower = find_spec("flower") is not None if flower is None else flower
        self.receiver_count = receivers
        self.worker_concurrency = worker_concurrency
        self.timeout = timeout
        base = config or DCSConfig()
        token = base.token() or secrets.token_urlsafe(32)
        port = coordinator_port or free_port()
        update: dict[str, Any] = {
            "auth_token": SecretStr(token),
            "coordinator_host": LOOPBACK,
            "coordinator_port": port,
            "coordinator_url": f"http://{LOOPBACK}:{port}",
        }
        if base.metrics.enable_metrics and base.metrics.port:
            update["metrics_port"] = free_port()  # the default 9090 may be taken by anything else
        self.config = base.model_copy(update=update)
        self.flower_port = flower_port or (free_port() if self.want_flower else 0)
        self.redis: LocalRedis | None = None
        self.services: list[Service] = []
        self._receiver_urls: list[str] = []
        self._lock = threading.Lock()
        self._workdir_lock: int | None = None
        self._started = False

    # --- what a trainer needs ---------------------------------------------------------------------
    @property
    def coordinator_url(self) -> str:
        return self.config.base_url

    @property
    def flower_url(self) -> str | None:
        return f"http://{LOOPBACK}:{self.flower_port}" if self.want_flower else None

    @property
    def receiver_urls(self) -> list[str]:
        return list(self._receiver_urls)

    def env(self) -> dict[str, str]:
        """Environment of a process that uses this stack: this process's minus `DCS_*`, plus the stack's."""
        return child_environ(self.config.to_env())

    # --- lifecycle ---------------------------------------------------------------------------------
    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> LocalStack:
        """Start every process; on any failure (or Ctrl-C) stop what was started and re-raise."""
        if self._started:
            raise LocalStackError("this LocalStack was started already")
        self._started = True
        self.workdir.mkdir(parents=True, exist_ok=True, mode=0o700)
        atexit.register(self.stop)
        try:
            self._lock_workdir()
            self._start_all()
        except BaseException:
            self.stop()
            raise
        return self

    def _lock_workdir(self) -> None:
        """One stack per workdir: two private Redis servers appending to one AOF directory would corrupt it."""
        fd = os.open(self.workdir / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise LocalStackError(f"another local stack is running in {self.workdir}") from None
        self._workdir_lock = fd

    def _start_all(self) -> None:
        if self.private_redis:
            self.redis = LocalRedis(self.workdir / "redis")
            self.redis.start(self.timeout)
            self.config = self.config.model_copy(update={"redis_url": self.redis.url})
        else:
            self._check_given_redis()
        coordinator = self._spawn("coordinator", ["coordinator", "--log-level", "warning"])
        worker = self._spawn(
            "worker", ["worker", f"--concurrency={self.worker_concurrency}", "--pool=threads", "--loglevel=INFO"]
        )
        flower = self._start_flower() if self.want_flower else None
        coordinator.wait_until(self._healthy, self.timeout, f"{self.coordinator_url}/healthz")
        receivers = [self._start_receiver(rank) for rank in range(self.receiver_count)]
        worker.wait_until(self._worker_present, self.timeout, "its presence in Redis")
        for rank, receiver in enumerate(receivers):
            receiver.wait_until(functools.partial(self._registered, rank), self.timeout, "registration as rollout")
        if flower is not None:
            flower.wait_until(lambda: self._answers(f"{self.flower_url}/healthcheck"), self.timeout, "Flower")

    def _check_given_redis(self) -> None:
        """LocalStackError within a few seconds when the Redis of `DCS_REDIS_URL` does not answer: before, every
        process was started against it and the worker blamed after the full timeout."""
        import redis

        from dcs_tasks.config import mask_url_credentials
        from dcs_tasks.redisconn import sync_client

        timeout = min(REDIS_CHECK_SECONDS, self.config.redis.socket_timeout_seconds)
        client = sync_client(self.config, socket_timeout=timeout)
        try:
            client.ping()
        except redis.RedisError as exc:
            raise LocalStackError(
                f"Redis at {mask_url_credentials(self.config.redis.url)} does not answer "
                f"({self.config.scrub(str(exc))[:200]}). That URL comes from DCS_REDIS_URL in this environment "
                "(a dcs.env of an earlier `dcs up` sourced in this shell points at a Redis that stopped with it): "
                "unset it (`unset $(compgen -v DCS_)` clears every DCS_ setting) to let `dcs up` start its own "
                "Redis, or start the Redis it names"
            ) from None
        finally:
            client.close()

    def _spawn(self, name: str, args: list[str], extra: dict[str, str] | None = None) -> Service:
        env = child_environ(self.config.to_env(), extra)
        service = Service.dcs(name, args, env, self.logs / f"{name}.log").start()
        self.services.append(service)
        return service

    def _start_receiver(self, rank: int) -> Service:
        port = free_port()
        args = ["receiver", "--coordinator-url", self.coordinator_url, "--rank", str(rank)]
        args += ["--host", LOOPBACK, "--port", str(port)]
        self._receiver_urls.append(f"http://{LOOPBACK}:{port}")
        return self._spawn(f"receiver-{rank}", args)

    def _start_flower(self) -> Service:
        """Flower on 127.0.0.1 behind basic auth (user `dcs`, the stack's token): its API can revoke tasks
        and shut workers down. Options go by environment (FLOWER_*), so the token is not in `ps`."""
        extra = {
            "FLOWER_ADDRESS": LOOPBACK,
            "FLOWER_PORT": str(self.flower_port),
            "FLOWER_BASIC_AUTH": f"dcs:{self.config.token()}",
            "FLOWER_PURGE_OFFLINE_WORKERS": "60",
        }
        env = child_environ(self.config.to_env(), extra)
        argv = ["-m", "celery", "-A", "workers.celery", "flower"]
        service = Service("flower", [sys.executable, *argv], env, self.logs / "flower.log").start()
        self.services.append(service)
        return service

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.config.token()}"}

    def _healthy(self) -> bool:
        return self._answers(f"{self.coordinator_url}/healthz")

    def _answers(self, url: str) -> bool:
        return httpx.get(url, timeout=2).status_code < 500

    def _worker_present(self) -> bool:
        from dcs_tasks.celery_app import node_queue
        from dcs_tasks.keys import Keys
        from dcs_tasks.redisconn import sync_client

        client = sync_client(self.config, socket_timeout=2)
        try:
            return bool(
                client.exists(Keys(self.config.redis.namespace).worker_presence(node_queue(self.config.host_name)))
            )
        finally:
            client.close()

    def _registered(self, rank: int) -> bool:
        url = f"{self.coordinator_url}/topology"
        answer = httpx.get(url, params={"role_filter": "rollout"}, headers=self._headers(), timeout=5)
        answer.raise_for_status()
        return str(rank) in answer.json()["nodes"].get("rollout", {})

    def check_alive(self) -> None:
        """LocalStackError naming the first process of the stack that exited."""
        for service in ([self.redis.service] if self.redis and self.redis.service else []) + self.services:
            service.check_alive()

    def stop(self) -> None:
        """Stop every process, newest first, then Redis (its AOF is flushed on SIGTERM). Idempotent; Ctrl-C
        is ignored meanwhile (every wait inside is bounded)."""
        with self._lock, interrupts_deferred():
            while self.services:
                self.services.pop().stop()
            if self.redis is not None:
                self.redis.stop()
                self.redis = None
            if self._workdir_lock is not None:
                os.close(self._workdir_lock)  # releases the flock
                self._workdir_lock = None
        atexit.unregister(self.stop)
