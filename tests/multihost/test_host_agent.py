"""The host agent across simulated hosts: trainer ranks, `dcs receiver`s and a `dcs engine attach` on two hosts
register and beat through their host's `dcs worker` (one POST /heartbeats per interval per host, no per-node
GET /heartbeat); a killed trainer and a frozen one (SIGSTOP) leave the topology within the timeout; a killed
worker's nodes beat for themselves and go back to the agent when a worker returns."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from dcs_tasks.hostagent import LEASE_RENEWALS, agent_socket_path, renew_period
from tests.helpers.procs import REPO
from tests.multihost.cluster import Cluster, TrainerRank
from tests.multihost.hosts import HostNetwork, HostProcess, SimulatedHost

pytestmark = [pytest.mark.multihost, pytest.mark.integration]

AGENT_NODE = "tests.multihost.agent_node"
INTERVAL, TIMEOUT = 0.5, 3.0
SLACK = 1.5  # a loaded 2-core machine: topology polls, process scheduling


@pytest.fixture
def agent_cluster(host_network: HostNetwork, tmp_path: Path) -> Iterator[Cluster]:
    cluster = Cluster(host_network, tmp_path, heartbeat_interval_seconds=INTERVAL, heartbeat_timeout_seconds=TIMEOUT)
    try:
        yield cluster
    finally:
        cluster.close()


def wait_until(what: str, check: Callable[[], bool], timeout: float, poll: float = 0.1) -> float:
    """Seconds until `check()` holds; TimeoutError naming `what` after `timeout`."""
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"{what}: not within {timeout}s")
        time.sleep(poll)
    return time.monotonic() - started


def live(url: str) -> dict[str, set[int]]:
    nodes = httpx.get(f"{url}/topology", timeout=10).json()["nodes"]
    return {role: {int(rank) for rank in ranks} for role, ranks in nodes.items()}


def requests_of(url: str, method: str, route: str) -> int:
    """The coordinator's count of `method route` requests, every status."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    pattern = rf'^dcs_coordinator_requests_total\{{method="{method}",route="{re.escape(route)}",status="\d+"\}} (\S+)$'
    return int(sum(float(v) for v in re.findall(pattern, text, re.M)))


def start_worker_with_agent(cluster: Cluster, host: SimulatedHost) -> HostProcess:
    return wait_worker_with_agent(cluster, cluster.spawn_worker(host))


def wait_worker_with_agent(cluster: Cluster, worker: HostProcess) -> HostProcess:
    """Until the worker serves its node queue and its agent listens."""
    cluster.wait_worker(worker)
    host = worker.host
    socket_path = agent_socket_path(cluster.config.model_copy(update={"node_name": host.name}))
    wait_until(f"the agent socket of {host.name}", (host.root / str(socket_path).lstrip("/")).exists, 30)
    return worker


def start_nodes(cluster: Cluster, url: str, placement: list[tuple[SimulatedHost, str, int]]) -> list[TrainerRank]:
    nodes = []
    for host, role, rank in placement:  # forked from the preloaded forkserver: no torch import each
        log = cluster.workdir / f"node-{host.name}-{role}-{rank}.log"
        args = [url, role, str(rank)]
        nodes.append(TrainerRank(host.spawn_python(AGENT_NODE, args, cluster.env(), log, REPO, pipes=True), rank))
    for node in nodes:
        first = node.answer(120)
        assert first.get("ready") and first["via_agent"], f"{first}; log: {node.log_tail()}"
    return nodes


@pytest.mark.slow
def test_a_hosts_processes_beat_through_its_worker_and_leave_when_killed_or_frozen(agent_cluster: Cluster) -> None:
    cluster = agent_cluster
    a, b = cluster.add_host("aa"), cluster.add_host("ab")
    url = cluster.start_coordinator(cluster.redis.host)
    cluster.config = cluster.config.model_copy(update={"coordinator_url": url})  # the workers' agents beat there
    workers = [cluster.spawn_worker(a), cluster.spawn_worker(b)]  # both come up together
    _, worker_b = [wait_worker_with_agent(cluster, worker) for worker in workers]
    actor0, actor1, actor2 = start_nodes(cluster, url, [(a, "actor", 0), (a, "actor", 1), (b, "actor", 2)])
    cluster.start_receiver(a, url, 0)  # rollout_0 on aa
    cluster.start_receiver(b, url, 0, "--role", "engine-self")  # the engine an attach on ab puts in as rollout_1
    attach = ["engine", "attach", "--coordinator-url", url, "--engine-url", f"http://{b.address}:30000", "--rank", "1"]
    b.spawn_python("dcs_tasks.cli.main", attach, cluster.env(), cluster.workdir / "attach-ab.log", REPO)
    everyone = {"actor": {0, 1, 2}, "rollout": {0, 1}, "engine-self": {0}}
    wait_until("every node registered", lambda: live(url) == everyone, 60)

    # nothing beats per node: every registration was a batch of an agent, every beat a POST /heartbeats
    time.sleep(3 * INTERVAL)
    assert requests_of(url, "GET", "/heartbeat") == 0
    assert requests_of(url, "POST", "/register") == 0
    assert requests_of(url, "POST", "/register_batch") >= 2
    assert requests_of(url, "POST", "/heartbeats") >= 4

    # identity fencing end to end: the agent's nodes are fenced like nodes beating themselves
    other = {"role_name": "actor", "rank": 2, "ip": "10.9.9.9", "port": 1}
    assert httpx.post(f"{url}/register", json=other, timeout=10).status_code == 409
    beat = {"beats": [{"role": "actor", "rank": 2, "identity": "10.9.9.9:1"}]}
    assert httpx.post(f"{url}/heartbeats", json=beat, timeout=10).json()["results"] == ["conflict"]

    # a killed trainer leaves within the timeout
    actor1.process.kill()
    gone = wait_until("killed actor_1 gone", lambda: 1 not in live(url)["actor"], TIMEOUT + 10)
    assert gone <= TIMEOUT + SLACK, f"killed actor_1 left after {gone:.1f}s (timeout {TIMEOUT}s)"

    # a frozen one too (its lease is not renewed, the agent stops beating it), and it is back once it runs again
    lease = LEASE_RENEWALS * renew_period(cluster.config)
    os.killpg(actor0.process.pid, signal.SIGSTOP)
    try:
        frozen = wait_until("frozen actor_0 gone", lambda: 0 not in live(url)["actor"], TIMEOUT + lease + 10)
        assert frozen <= TIMEOUT + lease + SLACK, f"frozen actor_0 left after {frozen:.1f}s"
        assert live(url)["actor"] == {2} and worker_b.alive()
    finally:
        os.killpg(actor0.process.pid, signal.SIGCONT)
    wait_until("actor_0 back after SIGCONT", lambda: 0 in live(url)["actor"], 10)

    # the worker of ab killed: its nodes beat per node themselves, and none leaves
    per_node_before = requests_of(url, "GET", "/heartbeat")
    worker_b.kill()
    on_b = {"actor": {0, 2}, "rollout": {0, 1}, "engine-self": {0}}
    deadline = time.monotonic() + TIMEOUT + 1
    while time.monotonic() < deadline:
        assert live(url) == on_b, "a node of ab left when its worker was killed"
        time.sleep(0.2)
    assert requests_of(url, "GET", "/heartbeat") - per_node_before >= 3 * 3  # three nodes of ab, every 0.5 s
    fell_back = actor2.ask({"op": "status"})
    assert fell_back["registered"] and not fell_back["via_agent"] and fell_back["fallbacks"] >= 1

    # a worker back on ab: its nodes go back to the agent; no per-node beat afterwards
    start_worker_with_agent(cluster, b)
    for node in (actor0, actor2):
        wait_until(
            f"actor_{node.rank} through the agent again", lambda n=node: n.ask({"op": "status"})["via_agent"], 10
        )
    time.sleep(2 * INTERVAL + 0.5)  # the receiver and the attach offer their node every interval too
    settled = requests_of(url, "GET", "/heartbeat")
    time.sleep(4 * INTERVAL)
    assert requests_of(url, "GET", "/heartbeat") == settled, "a node still beats per node with its worker back"
    assert live(url) == on_b
