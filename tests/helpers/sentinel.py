"""A private Redis Sentinel deployment on 127.0.0.1: a master, a replica and three sentinels on free ports.

Failover is tuned to take a few seconds: a node is subjectively down after `down_after_ms` (1 s), two of
the three sentinels must agree (quorum 2), and a failover is retried after `failover_timeout_ms`.
`min-replicas-to-write` is NOT set: after a failover the promoted replica is alone, and with it set to 1
every write would be refused until another replica attached. Replication is asynchronous, so a write the
master acknowledged but had not yet sent to the replica when it died is lost; `wait_replicated()` (Redis
`WAIT 1 <ms>`) marks the point up to which nothing can be lost.

Sentinels run as `redis-sentinel <conf>` (Debian's redis-sentinel package) or, when that binary is missing,
`redis-server <conf> --sentinel`: the same program in sentinel mode.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import redis

from tests.helpers.ports import free_port

MASTER_NAME = "dcsmaster"


def _binary(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        raise RuntimeError(f"{name} is not installed; `make test` installs redis-server and redis-sentinel with apt")
    return found


def _wait(predicate: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if callable(predicate) and predicate():
                return
        except redis.RedisError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{what} after {timeout}s")


class SentinelCluster:
    """Start with `start()`, stop with `stop()`; `kill_master()` is a kill -9 of the current master."""

    def __init__(
        self,
        workdir: Path,
        *,
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 3000,
        password: str | None = None,
        sentinel_password: str | None = None,
    ) -> None:
        self.workdir = workdir
        self.password = password  # requirepass of master and replica
        self.sentinel_password = sentinel_password  # requirepass of the sentinels
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.data_ports = [free_port(), free_port()]  # [initial master, initial replica]
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        """The DCS setting: `sentinel://host1:port1,host2:port2,host3:port3/<master>/0`."""
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)
        auth = f":{self.password}@" if self.password else ""
        query = f"?sentinel_password={self.sentinel_password}" if self.sentinel_password else ""
        return f"sentinel://{auth}{hosts}/{MASTER_NAME}/0{query}"

    def _spawn(self, port: int, args: list[str]) -> None:
        log = (self.workdir / f"{port}.log").open("ab")
        self.procs[port] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)

    def _start_data_node(self, port: int, replica_of: int | None) -> None:
        folder = self.workdir / f"redis-{port}"
        folder.mkdir(parents=True, exist_ok=True)
        args = [_binary("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder)]
        args += ["--save", "", "--appendonly", "no", "--maxmemory-policy", "noeviction"]
        args += ["--repl-diskless-sync-delay", "0"]  # a replica syncs at once (Redis 7 waits 5 s by default)
        if self.password:  # masterauth: a replica promoted later must still reach the other node
            args += ["--requirepass", self.password, "--masterauth", self.password]
        if replica_of is not None:
            args += ["--replicaof", "127.0.0.1", str(replica_of)]
        self._spawn(port, args)
        _wait(lambda: self.client(port).ping(), 10, f"redis-server on {port} did not answer")

    def _start_sentinel(self, port: int) -> None:
        conf = self.workdir / f"sentinel-{port}.conf"  # sentinels rewrite their config: one file each
        conf.write_text(
            f"port {port}\nbind 127.0.0.1\ndir {self.workdir}\n"
            f"sentinel monitor {MASTER_NAME} 127.0.0.1 {self.data_ports[0]} 2\n"
            f"sentinel down-after-milliseconds {MASTER_NAME} {self.down_after_ms}\n"
            f"sentinel failover-timeout {MASTER_NAME} {self.failover_timeout_ms}\n"
            f"sentinel parallel-syncs {MASTER_NAME} 1\n"
            + (f"sentinel auth-pass {MASTER_NAME} {self.password}\n" if self.password else "")
            + (
                f"requirepass {self.sentinel_password}\nsentinel sentinel-pass {self.sentinel_password}\n"
                if self.sentinel_password
                else ""
            )
        )
        sentinel = shutil.which("redis-sentinel")
        args = [sentinel, str(conf)] if sentinel else [_binary("redis-server"), str(conf), "--sentinel"]
        self._spawn(port, args)

    def start(self, timeout: float = 20.0) -> SentinelCluster:
        self.workdir.mkdir(parents=True, exist_ok=True)
        master, replica = self.data_ports
        self._start_data_node(master, None)
        self._start_data_node(replica, master)
        _wait(lambda: self.client(replica).info("replication")["master_link_status"] == "up", timeout, "no replica")
        for port in self.sentinel_ports:
            self._start_sentinel(port)
        _wait(self._sentinels_see_everything, timeout, "sentinels did not discover the replica and each other")
        return self

    def _sentinels_see_everything(self) -> bool:
        for port in self.sentinel_ports:
            state = self.client(port).sentinel_master(MASTER_NAME)
            if int(state["num-slaves"]) < 1 or int(state["num-other-sentinels"]) < 2:
                return False
        return True

    def client(self, port: int) -> redis.Redis:
        password = self.sentinel_password if port in self.sentinel_ports else self.password
        return redis.Redis(
            port=port, password=password, socket_timeout=1, socket_connect_timeout=1, decode_responses=True
        )

    def master_port(self) -> int:
        """The master's port as the sentinels report it now."""
        return int(self.client(self.sentinel_ports[0]).sentinel_get_master_addr_by_name(MASTER_NAME)[1])

    def master(self) -> redis.Redis:
        return self.client(self.master_port())

    def wait_replicated(self, timeout_ms: int = 2000) -> int:
        """Redis `WAIT 1 <timeout_ms>` on the master: how many replicas acknowledged every write so far."""
        return int(self.master().execute_command("WAIT", 1, timeout_ms))

    def kill_master(self) -> int:
        """kill -9 the current master (no shutdown, no last sync); returns its port."""
        port = self.master_port()
        self.procs[port].kill()
        self.procs[port].wait(10)
        return port

    def wait_promoted(self, old_port: int, timeout: float = 30.0) -> int:
        """Block until every sentinel names a new master that answers as master; returns its port."""

        def promoted() -> bool:
            ports = {self.client(p).sentinel_get_master_addr_by_name(MASTER_NAME)[1] for p in self.sentinel_ports}
            if len(ports) != 1 or int(next(iter(ports))) == old_port:
                return False
            return bool(self.master().info("replication")["role"] == "master")

        _wait(promoted, timeout, f"no replica was promoted after master {old_port} died")
        return self.master_port()

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        self.procs.clear()
