"""Weight sync across simulated hosts: an actor (trainer script + its `dcs worker`) on one host, `dcs receiver`s
on others, gloo over the veths, every address at its default except the coordinator URL."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.multihost.cluster import Cluster, TrainerRank
from tests.multihost.hosts import HostProcess, SimulatedHost

pytestmark = [pytest.mark.multihost, pytest.mark.integration]

COMM_TIMEOUT = 4.0  # a 2 MiB bucket crosses a veth in milliseconds
SYNC_ENV = {
    "DCS_COMM_TIMEOUT_SECONDS": str(COMM_TIMEOUT),
    "DCS_GROUP_INIT_TIMEOUT_SECONDS": "20",
    "DCS_BUCKET_SIZE_BYTES": str(2 * 1024 * 1024),  # 8 MiB of weights: 5 buckets
}


def digest(url: str) -> dict[str, Any]:
    answer: dict[str, Any] = httpx.get(f"{url}/weights_digest", timeout=10).json()
    return answer


def update(trainer: TrainerRank, seed: int, timeout: float = 90.0) -> dict[str, Any]:
    answer = trainer.ask({"op": "update", "seed": seed}, timeout=timeout)
    assert answer["ok"], f"{answer}; trainer log: {trainer.log_tail()}"
    return answer


def actor_host(cluster: Cluster, name: str) -> tuple[SimulatedHost, str, HostProcess]:
    """A host for the actor with its `dcs worker` (still starting: `cluster.wait_worker` before the actor starts),
    and the coordinator's URL (on the Redis host)."""
    host = cluster.add_host(name)
    worker = cluster.spawn_worker(host, **SYNC_ENV)
    url = cluster.start_coordinator(cluster.redis.host)
    return host, url, worker


def start_receivers(cluster: Cluster, url: str, hosts: list[SimulatedHost]) -> list[str]:
    """`dcs receiver` rank i on hosts[i], started together; their URLs once each answers /health."""
    with ThreadPoolExecutor(len(hosts)) as pool:
        started = [pool.submit(cluster.start_receiver, host, url, rank, **SYNC_ENV) for rank, host in enumerate(hosts)]
        return [receiver.result() for receiver in started]


@pytest.mark.slow
def test_weights_cross_hosts_bit_exact_and_a_cut_receiver_fails_only_that_update(cluster: Cluster) -> None:
    a, url, worker = actor_host(cluster, "ta")
    b, c = cluster.add_host("rb"), cluster.add_host("rc")
    on_b, on_c = start_receivers(cluster, url, [b, c])
    cluster.wait_worker(worker)
    trainer = cluster.start_sync_trainer(a, url, **SYNC_ENV)

    for seed in (1, 2):
        sent = update(trainer, seed)
        assert sent["ip"] == a.address  # found from the route to the coordinator, not 127.0.0.1
        assert sent["metrics"]["weight_version"] == seed and sent["metrics"]["buckets"] >= 3
        for receiver in (on_b, on_c):
            assert digest(receiver) == {"weight_version": seed, "tensors": sent["digest"]}
    old, new = sent["digest"], trainer.ask({"op": "state", "seed": 3})["digest"]

    # cut C's cable once the first bucket is on both receivers, before the second is announced
    trainer.send({"op": "update", "seed": 3, "hold": 1})
    assert trainer.answer(60).get("held") == 1
    c.link_down()
    try:
        cut = time.monotonic()
        trainer.send({"op": "go"})
        failed = trainer.answer(60)
        took = time.monotonic() - cut
        print(f"update with rc cut failed after {took:.1f}s: {failed['error'][:400]}")
        assert not failed["ok"] and failed["error"].startswith("WeightSyncError")
        assert "rollout_1" in failed["error"], failed["error"]
        # detected at the comm timeout, named by a /health probe; the cut engine is not called again
        assert took < COMM_TIMEOUT + 3 + 4, took  # + the 3-s /health probe that names it, + slack
        on_b_now = digest(on_b)
        assert on_b_now["tensors"] in (old, new)  # never a mix of the two
        assert on_b_now == {"weight_version": 2, "tensors": old}  # the update failed: B committed nothing
    finally:
        c.link_up()
        cluster.network.wait_link(c)

    sent = update(trainer, 4)
    assert sent["metrics"]["group_rebuilt"] and sent["metrics"]["engines"] == 2
    assert sent["metrics"]["weight_version"] == 3  # the failed v3 was never published
    for receiver in (on_b, on_c):
        assert digest(receiver) == {"weight_version": 3, "tensors": sent["digest"]}


def test_a_hostname_resolving_to_loopback_still_forms_the_group(cluster: Cluster, tmp_path: Path) -> None:
    a, b = cluster.add_host("la"), cluster.add_host("lb")
    for host in (a, b):  # the common Debian/Ubuntu line: the hostname resolves to 127.0.1.1
        host.use_hosts_file(f"127.0.0.1 localhost\n127.0.1.1 {host.name}\n", tmp_path)
        assert host.run(["getent", "hosts", host.name], cwd=tmp_path).stdout.split()[0] == "127.0.1.1"
    worker = cluster.spawn_worker(a, **SYNC_ENV)
    url = cluster.start_coordinator(cluster.redis.host)
    on_b = cluster.start_receiver(b, url, 0, **SYNC_ENV)
    cluster.wait_worker(worker)
    trainer = cluster.start_sync_trainer(a, url, **SYNC_ENV)
    sent = update(trainer, 7)
    assert digest(on_b) == {"weight_version": 1, "tensors": sent["digest"]}


def test_a_loopback_master_with_a_remote_receiver_fails_at_once_by_name(cluster: Cluster) -> None:
    a, b = cluster.add_host("pa"), cluster.add_host("pb")
    url = cluster.start_coordinator(cluster.redis.host)
    on_b = cluster.start_receiver(b, url, 0, **SYNC_ENV)
    trainer = cluster.start_sync_trainer(a, url, "127.0.0.1", **SYNC_ENV)  # the seed's old default ip=
    answer = trainer.ask({"op": "update", "seed": 1}, timeout=60)
    assert not answer["ok"] and answer["error"].startswith("LoopbackAddressError"), answer
    assert f"127.0.0.1 is loopback but rollout_0 is at {b.address}" in answer["error"]
    assert answer["seconds"] < 5  # before any join is sent: no worker on pa is even needed
    assert digest(on_b)["weight_version"] == 0
