"""redis-server processes for tests.

`RedisServer`: a private server on a free port that a test can stop, kill and restart (same port, same data
dir; AOF with appendfsync always, so a kill -9 loses nothing acknowledged).
`RedisDB`: one test's database on a server shared by the tests of one pytest process (tests/conftest.py): the
test gets a database index no other test uses, so its keys, Celery queues and results are its own. It cannot be
stopped or restarted; a test that takes Redis down asks for its own server (`@pytest.mark.own_redis`)."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import redis

from tests.helpers.ports import free_port


class RedisServer:
    def __init__(self, workdir: Path, *, appendonly: bool = True, port: int | None = None, databases: int = 16) -> None:
        self.workdir = workdir
        self.databases = databases
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.appendonly = appendonly
        self.proc: subprocess.Popen[bytes] | None = None
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed; `make test` installs it with apt")
        self.binary = binary

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> None:
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.workdir),
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--appendfsync",
            "always",
            "--save",
            "",
            "--maxmemory-policy",
            "noeviction",
            "--protected-mode",
            "yes",
            "--logfile",
            str(self.workdir / "redis.log"),
            "--databases",
            str(self.databases),
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        client = redis.Redis(port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5)
        while time.monotonic() < deadline:
            try:
                if client.ping():
                    client.close()
                    return
            except redis.RedisError:
                time.sleep(0.05)
        raise TimeoutError(f"redis-server on port {self.port} did not answer within {timeout}s")

    def stop(self, timeout: float = 10.0) -> None:
        """Graceful SHUTDOWN (AOF is flushed)."""
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout)
        self.proc = None

    def kill(self) -> None:
        """kill -9: no shutdown, only what AOF (appendfsync always) already has survives."""
        if self.proc is None:
            return
        self.proc.kill()
        self.proc.wait(10)
        self.proc = None

    def restart(self, down_seconds: float = 0.0) -> None:
        self.stop()
        time.sleep(down_seconds)
        self.start()

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=5, decode_responses=True)


class RedisDB:
    """Database `db` of a shared, running `RedisServer`: what a test that does not take Redis down needs."""

    def __init__(self, server: RedisServer, db: int) -> None:
        if not 0 <= db < server.databases:
            raise ValueError(f"database {db} is outside the shared server's {server.databases}")
        self.server = server
        self.db = db

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.server.port}/{self.db}"

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.server.port, db=self.db, socket_timeout=5, decode_responses=True)

    def flush(self) -> None:
        """Free this test's keys (FLUSHDB ASYNC); the index is never handed out again, so a straggling process
        of the test that writes afterwards cannot reach another test."""
        client = redis.Redis(port=self.server.port, db=self.db, socket_timeout=5)
        try:
            client.flushdb(asynchronous=True)
        finally:
            client.close()

    def _shared(self, *_: object, **__: object) -> None:
        raise RuntimeError(
            "this test's Redis is a database on a shared server: mark the test @pytest.mark.own_redis to get a "
            "private server it can stop, kill or restart"
        )

    stop = kill = start = restart = _shared
