"""A DCS cluster on simulated hosts: Redis on a host of its own, `dcs worker`s and trainer ranks inside hosts.

    cluster = Cluster(network, tmp_path)            # host "redis": redis-server on 10.213.N.11:6379
    a = cluster.add_host("ha")                       # hostname ha, own /dev/shm, 10.213.N.12
    cluster.start_worker(a)                          # `dcs worker` inside ha: queue dcs.node.ha
    url = cluster.start_coordinator(a)               # `dcs coordinator` bound to ha's address
    rank0 = cluster.start_trainer(a, "run", rank=0, world=4)
    rank0.ask({"op": "save", "step": 10, "wait": 60})
    cluster.close()                                  # every process, every host, Redis

Every process gets the cluster's `DCS_*` environment and no node name, so each finds its host's queue from
its hostname, as it would on a real host.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import redis

from dcs_tasks.celery_app import make_celery, node_queue
from dcs_tasks.config import DCSConfig
from dcs_tasks.keys import Keys
from tests.helpers.procs import REPO, child_env
from tests.multihost.hosts import HostNetwork, HostProcess, SimulatedHost

TRAINER = "tests.multihost.trainer"  # python modules the hosts run, forked with torch and DCS imported (inhost.py)
SYNC_TRAINER = "tests.multihost.sync_trainer"


class HostRedis:
    """redis-server on a host of its own (so a sweep after a killed session ends it too), on that host's
    bridge address: every host, and the test process in the root namespace, reach it over the bridge."""

    PORT = 6379

    def __init__(self, host: SimulatedHost, workdir: Path) -> None:
        self.host = host
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"redis://{self.host.address}:{self.PORT}/0"

    def start(self, timeout: float = 10.0) -> HostRedis:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed; `make test` installs it with apt")
        argv = [binary, "--port", str(self.PORT), "--bind", self.host.address, "--dir", str(self.workdir)]
        argv += ["--save", "", "--appendonly", "no", "--protected-mode", "no"]
        process = self.host.spawn(argv, dict(os.environ), self.workdir / "redis.log", self.workdir)
        client = self.client()
        deadline = time.monotonic() + timeout
        while True:
            try:
                client.ping()
                return self
            except redis.RedisError:
                if not process.alive() or time.monotonic() > deadline:
                    log = process.log_text()[-2000:]
                    raise RuntimeError(f"redis-server on {self.url} did not start: {log}") from None
                time.sleep(0.05)

    def client(self) -> redis.Redis:
        return redis.Redis(host=self.host.address, port=self.PORT, socket_timeout=5, decode_responses=True)


class TaskEvents:
    """The Celery task events (`dcs worker` runs with -E) every worker sends, captured in the test process:
    which worker (`dcs@<host>`) received which task with which arguments."""

    def __init__(self, config: DCSConfig) -> None:
        self.app = make_celery(config)
        self.received: list[dict[str, Any]] = []
        self._ready = threading.Event()
        self._receiver: Any = None
        self._thread = threading.Thread(target=self._capture, name="task-events", daemon=True)

    def start(self, timeout: float = 10.0) -> TaskEvents:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("the task event receiver did not connect")
        return self

    def _capture(self) -> None:
        with self.app.connection_for_read() as conn:
            receiver = self.app.events.Receiver(conn, handlers={"task-received": self.received.append})
            declared = receiver.on_consume_ready

            def on_ready(*args: Any, **kwargs: Any) -> None:
                declared(*args, **kwargs)
                self._ready.set()

            receiver.on_consume_ready = on_ready
            self._receiver = receiver
            for _ in receiver.consume(limit=None, wakeup=False):
                pass

    def stop(self) -> None:
        if self._receiver is not None:
            self._receiver.should_stop = True
        self._thread.join(5)

    def hosts_by_run(self, task: str) -> dict[str, set[str]]:
        """run name in the payload -> hostnames of the workers that received `task` for it."""
        seen: dict[str, set[str]] = {}
        for event in self.received:
            if event.get("name") == task:
                run = re.search(r"'run': '([^']+)'", event.get("args", ""))
                host = str(event.get("hostname", "")).removeprefix("dcs@")
                seen.setdefault(run[1] if run else "?", set()).add(host)
        return seen


class TrainerRank:
    """A trainer rank (`tests/multihost/trainer.py`) inside a host, driven by JSON lines."""

    def __init__(self, process: HostProcess, rank: int) -> None:
        self.process = process
        self.rank = rank

    def ask(self, cmd: dict[str, Any], timeout: float = 90.0) -> dict[str, Any]:
        """Send one command; its answer (raises when the rank dies or does not answer in time)."""
        self.send(cmd)
        return self.answer(timeout)

    def send(self, cmd: dict[str, Any]) -> None:
        proc = self.process.proc
        assert proc.stdin is not None
        proc.stdin.write((json.dumps(cmd) + "\n").encode())
        proc.stdin.flush()

    def answer(self, timeout: float) -> dict[str, Any]:
        proc = self.process.proc
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        line = proc.stdout.readline() if ready else b""
        if not line:
            raise TimeoutError(f"rank {self.rank} on {self.process.host.name}: no answer; log: {self.log_tail()}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def log_tail(self, n: int = 3000) -> str:
        return self.process.log_text()[-n:]


class Cluster:
    """Hosts of one test, the Redis they share and the DCS processes on them; `close()` removes all."""

    def __init__(self, network: HostNetwork, workdir: Path, **config: Any) -> None:
        self.network = network
        self.workdir = workdir
        self.hosts: list[SimulatedHost] = []
        self.redis = HostRedis(self.add_host("redis"), workdir / "redis").start()
        self.config = DCSConfig(
            redis_url=self.redis.url,
            checkpoint_dir=workdir / "shared-ckpt",  # the same path on every host
            enable_metrics=False,
            redis_socket_timeout_seconds=2.0,
            retry_delay_seconds=0.05,
            retry_backoff_max_seconds=0.2,
            max_retries=2,
            **config,
        )
        self.keys = Keys(self.config.redis.namespace)

    def add_host(self, name: str) -> SimulatedHost:
        host = self.network.add_host(name)
        self.hosts.append(host)
        return host

    def env(self, **extra: str) -> dict[str, str]:
        return child_env(self.config, **extra)

    def start_worker(self, host: SimulatedHost, timeout: float = 60.0, **env: str) -> HostProcess:
        """`dcs worker` inside `host`; returns once its node queue's presence key is in Redis."""
        worker = self.spawn_worker(host, **env)
        self.wait_worker(worker, timeout)
        return worker

    def spawn_worker(self, host: SimulatedHost, **env: str) -> HostProcess:
        """`dcs worker` inside `host`, not waited for: the test starts what else it needs while the worker comes
        up (a few seconds), then `wait_worker`."""
        dcs = Path(sys.executable).with_name("dcs")
        argv = [str(dcs), "worker", "--concurrency=2", "--loglevel=INFO"]
        return host.spawn(argv, self.env(**env), self.workdir / f"worker-{host.name}.log", REPO)

    def wait_worker(self, worker: HostProcess, timeout: float = 60.0) -> None:
        """Until the node queue of `worker`'s host has its presence key in Redis (the worker serves it)."""
        key = self.keys.worker_presence(node_queue(worker.host.name))
        client = self.redis.client()
        deadline = time.monotonic() + timeout
        while not client.exists(key):
            if not worker.alive() or time.monotonic() > deadline:
                worker.kill()
                raise RuntimeError(f"worker on {worker.host.name} not ready; log: {worker.log_text()[-3000:]}")
            time.sleep(0.05)

    def start_coordinator(self, host: SimulatedHost, port: int = 8000, timeout: float = 60.0) -> str:
        """`dcs coordinator` inside `host`, bound to the host's address; returns its URL once it listens."""
        dcs = Path(sys.executable).with_name("dcs")
        argv = [str(dcs), "coordinator", "--host", host.address, "--port", str(port)]
        process = host.spawn(argv, self.env(), self.workdir / f"coordinator-{host.name}.log", REPO)
        deadline = time.monotonic() + timeout
        while True:
            try:
                socket.create_connection((host.address, port), timeout=0.5).close()
                return f"http://{host.address}:{port}"
            except OSError:
                if not process.alive() or time.monotonic() > deadline:
                    process.kill()
                    raise RuntimeError(f"coordinator on {host.name} not up: {process.log_text()[-3000:]}") from None
                time.sleep(0.1)

    def start_receiver(
        self, host: SimulatedHost, coordinator_url: str, rank: int, *args: str, port: int = 30000, **env: str
    ) -> str:
        """`dcs receiver --coordinator-url URL --rank N --port P [args]` inside `host`, every address left at its
        default; returns its URL (the host's address) once it answers /health (it registers before serving)."""
        argv = ["receiver", "--coordinator-url", coordinator_url, "--rank", str(rank), "--port", str(port), *args]
        log = self.workdir / f"receiver-{host.name}.log"
        process = host.spawn_python("dcs_tasks.cli.main", argv, self.env(**env), log, REPO)
        url = f"http://{host.address}:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
            if not process.alive() or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(f"receiver on {host.name} not up: {process.log_text()[-3000:]}")
            time.sleep(0.2)

    def start_sync_trainer(self, host: SimulatedHost, coordinator_url: str, *args: str, **env: str) -> TrainerRank:
        """A weight-sync trainer (`python -m tests.multihost.sync_trainer URL [args]`) inside `host`."""
        log = self.workdir / f"sync-trainer-{host.name}.log"
        argv = [coordinator_url, *args]
        trainer = TrainerRank(host.spawn_python(SYNC_TRAINER, argv, self.env(**env), log, REPO, pipes=True), 0)
        first = trainer.answer(90)
        if not first.get("ready"):
            raise RuntimeError(f"sync trainer on {host.name} did not start: {first}")
        return trainer

    def start_trainers(self, run: str, world: int, placement: list[tuple[SimulatedHost, int]]) -> list[TrainerRank]:
        """Trainer ranks of one job, `(host, rank)` each, started together; returns once all are ready."""
        trainers = []
        for host, rank in placement:
            argv = [run, str(rank), str(world)]
            log = self.workdir / f"trainer-{run}-{host.name}-{rank}-of-{world}.log"
            trainers.append(TrainerRank(host.spawn_python(TRAINER, argv, self.env(), log, REPO, pipes=True), rank))
        for trainer in trainers:
            first = trainer.answer(90)
            if not first.get("ready"):
                raise RuntimeError(f"trainer rank {trainer.rank} did not start: {first}")
        return trainers

    def start_trainer(self, host: SimulatedHost, run: str, rank: int, world: int, **env: str) -> TrainerRank:
        """One trainer rank in `host` (`env`: extra variables, e.g. a wrong DCS_NODE_NAME)."""
        log = self.workdir / f"trainer-{run}-{host.name}-{rank}-of-{world}.log"
        argv = [run, str(rank), str(world)]
        trainer = TrainerRank(host.spawn_python(TRAINER, argv, self.env(**env), log, REPO, pipes=True), rank)
        first = trainer.answer(90)
        if not first.get("ready"):
            raise RuntimeError(f"trainer rank {rank} on {host.name} did not start: {first}")
        return trainer

    def close(self) -> None:
        for host in self.hosts:
            self.network.remove_host(host.name)
        self.hosts.clear()
