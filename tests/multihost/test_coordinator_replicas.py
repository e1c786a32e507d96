"""Coordinator replicas behind HAProxy: two `dcs coordinator`s on two hosts, HAProxy on a third, clients in the
test process. One replica is killed with -9 while 50 nodes register and beat and a weight-meta long-poll waits;
the clients' bounded retries (dcs_tasks/coordinator_api.py) and HAProxy's health checks and redispatch
absorb it: no call fails, no rank is taken twice, the long-poll returns the entry appended after the kill."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from dcs_tasks.config import RoleInfo
from dcs_tasks.coordinator_api import CoordinatorAPI
from dcs_tasks.models import WeightMeta
from tests.helpers.haproxy import Backend, HAProxy, HAProxyConfig
from tests.helpers.procs import REPO
from tests.multihost.cluster import Cluster
from tests.multihost.hosts import HostProcess, SimulatedHost

pytestmark = [pytest.mark.multihost, pytest.mark.integration, pytest.mark.slow]

NODES = 50
BEAT_S = 0.05
PORT = 8000


@dataclass
class Replicas:
    proxy: HAProxy
    hosts: dict[str, SimulatedHost]  # HAProxy server name -> the coordinator's host

    def coordinator(self, server: str) -> HostProcess:
        host = self.hosts[server]
        return next(p for p in host.processes if p.log_path.name == f"coordinator-{host.name}.log")


@pytest.fixture
def replicas(cluster: Cluster, tmp_path: Path) -> Iterator[Replicas]:
    hosts = {"c1": cluster.add_host("coord1"), "c2": cluster.add_host("coord2")}
    lb = cluster.add_host("lb")
    with ThreadPoolExecutor(2) as pool:  # both replicas start at once (each takes seconds to import)
        list(pool.map(cluster.start_coordinator, hosts.values()))
    backends = [Backend(name, host.address, PORT) for name, host in hosts.items()]
    proxy = HAProxy(HAProxyConfig(lb.address, PORT, backends), tmp_path / "haproxy")

    def in_lb_host(argv: Sequence[str], log: Path) -> HostProcess:
        return lb.spawn(argv, dict(os.environ), log, REPO)

    proxy.start(launch=in_lb_host)
    try:
        proxy.wait_states({"c1": "UP", "c2": "UP"})
        yield Replicas(proxy, hosts)
    finally:
        proxy.stop()


@dataclass
class NodeRun:
    rank: int | None = None
    beats: int = 0
    slowest_call_s: float = 0.0
    retries: int = 0


async def run_node(url: str, i: int, stop: asyncio.Event, run: NodeRun) -> None:
    """Register node i (a port: a retried registration keeps its rank), then beat every BEAT_S until `stop`.
    Any error a call raises ends the node, and the test with it."""
    # registrations spread over 5 s: the kill comes once a third are in, and a loaded machine that starves this
    # process for a second or two (as a CI run once did, when they were spread over 2 s) still leaves some to go
    await asyncio.sleep(i * 0.1)
    info = RoleInfo(role_name="rollout", ip="10.250.0.1", port=20000 + i)
    async with CoordinatorAPI(url, timeout=5, retry_for_s=10) as api:
        began = time.monotonic()
        run.rank = (await api.register(info)).rank
        run.slowest_call_s = time.monotonic() - began
        while not stop.is_set():
            began = time.monotonic()
            await api.heartbeat("rollout", run.rank, ip=info.ip, port=info.port)
            run.slowest_call_s = max(run.slowest_call_s, time.monotonic() - began)
            run.beats += 1
            run.retries = api.retries
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), BEAT_S)


def long_poll_holder(proxy: HAProxy, timeout: float = 10.0) -> str:
    """The server the (only) request in flight, the long-poll, was sent to: its `scur` is 1, and stays so for
    0.3 s. A lone sample can instead catch the server of the request before (`weight_meta_end`) while haproxy
    still closes that session, with the long-poll already on the other replica (seen once under load: the kill
    then missed the long-poll)."""
    deadline = time.monotonic() + timeout
    holder, since = None, time.monotonic()
    while time.monotonic() < deadline:
        busy = [name for name, row in proxy.stats().items() if row["scur"] == "1"]
        now = busy[0] if len(busy) == 1 else None
        if now != holder:
            holder, since = now, time.monotonic()
        elif holder is not None and time.monotonic() - since >= 0.3:
            return holder
        time.sleep(0.02)
    raise TimeoutError(f"no server holds the long-poll: {proxy.stats()}")


async def wait_until(predicate: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"condition not met within {timeout}s"
        await asyncio.sleep(0.02)


async def test_killing_a_coordinator_replica_costs_clients_only_a_bounded_retry(replicas: Replicas) -> None:
    proxy = replicas.proxy
    entry = WeightMeta(names=["after-the-kill"], dtypes=["float32"], shapes=[[4]], group_name="g")
    async with CoordinatorAPI(proxy.url, timeout=5, retry_for_s=15) as reader, CoordinatorAPI(proxy.url) as sender:
        start = await reader.weight_meta_end()
        poll = asyncio.create_task(reader.recv_weight_meta(start, wait_timeout_s=45))
        victim = await asyncio.to_thread(long_poll_holder, proxy)
        survivor = next(name for name in replicas.hosts if name != victim)

        stop, runs = asyncio.Event(), [NodeRun() for _ in range(NODES)]
        began = time.monotonic()
        nodes = [asyncio.create_task(run_node(proxy.url, i, stop, run)) for i, run in enumerate(runs)]
        await wait_until(lambda: sum(r.rank is not None for r in runs) >= NODES // 3, 20)
        replicas.coordinator(victim).kill()  # SIGKILL: in-flight requests and the long-poll are cut
        registered_at_kill = sum(r.rank is not None for r in runs)
        served_by_victim = int(proxy.stats()[victim]["stot"])  # haproxy keeps a dead server's counters
        beats_at_kill = [r.beats for r in runs]

        await asyncio.sleep(1.0)
        await sender.send_weight_meta(entry)
        batch = await asyncio.wait_for(poll, 20)
        await asyncio.wait_for(asyncio.to_thread(proxy.wait_states, {victim: "DOWN", survivor: "UP"}), 10)
        await wait_until(lambda: all(r.beats >= b + 5 for r, b in zip(runs, beats_at_kill, strict=True)), 20)
        stop.set()
        await asyncio.wait_for(asyncio.gather(*nodes), 30)  # re-raises the first error any node's call raised
        elapsed = time.monotonic() - began
        topology = await sender.topology("rollout")
        appended = await sender.recv_weight_meta(start)
        after = proxy.stats()

    slowest = max(r.slowest_call_s for r in runs)
    print(
        f"killed {victim} with {registered_at_kill}/{NODES} registered; retries: long-poll {reader.retries}, "
        f"nodes {sum(r.retries for r in runs)}; haproxy retries {after[victim]['wretr']}, redispatches "
        f"{after[victim]['wredis']}; slowest node call {slowest:.2f}s; {elapsed:.1f}s in all"
    )
    assert served_by_victim >= 10, "the killed replica was not serving the nodes' calls"
    assert registered_at_kill < NODES, "the kill came after every registration; it must hit them in flight"
    assert sorted(r.rank for r in runs if r.rank is not None) == list(range(NODES))
    assert batch.entries == [entry] and batch.first_index == start
    assert reader.retries >= 1, "the long-poll was not cut and re-issued"
    assert appended.entries == [entry], "the append was stored more than once"
    assert sorted(topology.nodes["rollout"]) == list(range(NODES))  # /topology lists live nodes only
    assert {info.port for info in topology.nodes["rollout"].values()} == {20000 + i for i in range(NODES)}
    assert slowest < 10, "a call took longer than its retry bound"
    assert elapsed < 40, f"the run took {elapsed:.1f}s"
