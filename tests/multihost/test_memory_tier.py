"""The memory tier across simulated hosts (network namespaces, each with its own /dev/shm): a trainer's steps are
copied over the hosts' links to a peer host's memory; when the trainer's whole host is lost (namespace, worker,
trainer and memory gone), a replacement rank on a third host restores from the peer's memory; a step that was
not replicated before the loss is not restored, the previous complete one is."""

from __future__ import annotations

import time
from typing import Any

import pytest

from dcs_tasks.checkpoint.store.tiers import peerchoice, stepplaces
from tests.multihost.cluster import Cluster
from tests.multihost.hosts import SimulatedHost
from tests.multihost.test_checkpoints import wait_for
from tests.multihost.trainer import digests, rank_state

pytestmark = [pytest.mark.multihost, pytest.mark.integration]

TOKEN = "multihost-memory-tier-token"


def tier_env(host: SimulatedHost, **extra: str) -> dict[str, str]:
    return {
        "DCS_AUTH_TOKEN": TOKEN,
        "DCS_MEMORY_TIER_BYTES": str(64 << 20),
        "DCS_MEMORY_REPLICAS": "1",
        "DCS_STORAGE_EVERY_STEPS": "1000",
        "DCS_PEER_HOST": host.address,
        **extra,
    }


def live_peers(cluster: Cluster) -> set[str]:
    return set(peerchoice.peers(cluster.redis.client(), cluster.keys))


def places(cluster: Cluster, run: str) -> dict[tuple[int, int], set[str]]:
    return stepplaces.Places(cluster.redis.client(), cluster.keys).read(run)


@pytest.mark.slow
def test_a_lost_hosts_rank_restores_from_a_peers_memory_on_a_third_host(cluster: Cluster) -> None:
    a, b, c = (cluster.add_host(name) for name in ("ha", "hb", "hc"))
    workers = [cluster.spawn_worker(host, **tier_env(host)) for host in (a, b)]
    trainer = cluster.start_trainer(a, "lost", 0, 1, **tier_env(a))
    for worker in workers:
        cluster.wait_worker(worker)

    def save(step: int) -> None:
        answer = trainer.ask({"op": "save", "step": step, "wait": 60})
        assert answer == {"ok": True, "status": "committed", "path": answer["path"]}, (answer, trainer.log_tail())

    save(10)
    wait_for(lambda: "replicated" in places(cluster, "lost").get((10, 0), set()), timeout=60)
    assert places(cluster, "lost")[(10, 0)] == {"mem@ha", "peer@hb", "replicated"}
    assert b.shm_files()  # the copy sits in host b's own /dev/shm

    b.link_down()  # host b unreachable: step 20's copy cannot be made
    try:
        wait_for(lambda: "hb" not in live_peers(cluster), timeout=30)  # its worker's presence expired
        save(20)
        wait_for(lambda: "copying" not in places(cluster, "lost").get((20, 0), {"copying"}), timeout=120)
        assert places(cluster, "lost")[(20, 0)] == {"mem@ha"}  # committed in host a's memory only
    finally:
        b.link_up()
    cluster.network.wait_link(b)
    wait_for(lambda: "hb" in live_peers(cluster), timeout=90)  # its worker is back (or restarted) and serves

    # host a is lost with everything on it; a replacement rank starts on host c (no worker needed to restore)
    cluster.network.remove_host("ha")
    cluster.hosts.remove(a)
    started = time.monotonic()
    replacement = cluster.start_trainer(c, "lost", 0, 1, **tier_env(c))
    answer: dict[str, Any] = replacement.ask({"op": "restore", "location": True}, timeout=120)
    assert answer == {"ok": True, "step": 10, "digests": digests(rank_state(10, 0, 1)), "location": "peer:hb"}, (
        answer,
        replacement.log_tail(),
    )
    assert time.monotonic() - started < 60
