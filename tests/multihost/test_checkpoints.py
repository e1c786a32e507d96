"""Checkpoints across simulated hosts: a W=4 run on two trainer hosts, each with its own `dcs worker` and its
own /dev/shm, one shared checkpoint directory; restores on a third host; a cut cable mid-persist.

Every process is started inside its host as an operator would start it there, configured only by `DCS_*`
variables without a node name: each trainer rank finds its host's queue `dcs.node.<hostname>` by itself.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.multihost.cluster import Cluster, TaskEvents, TrainerRank
from tests.multihost.hosts import SimulatedHost
from tests.multihost.trainer import digests, global_state, rank_state

pytestmark = [pytest.mark.multihost, pytest.mark.integration]

WORLD = 4
KiB = 1024
CUT_WAIT = 3.0  # how long ha's ranks wait for step 20 while its link is cut (Redis socket timeout: 2 s)
PERSIST = "dcs.ckpt.persist"
COMMIT = "dcs.ckpt.commit"


def expected(step: int, rank: int, world: int) -> dict[str, Any]:
    """Digests of rank `rank` of `world`'s part of `step` as the W=4 run saved it: the dim-split tensors
    resliced, the rank-local values of saving rank `rank` (rank 0 beyond the saved world)."""
    full = global_state(step, WORLD)
    model = {"w": torch.tensor_split(full["w"], world, 0)[rank], "col": torch.tensor_split(full["col"], world, 1)[rank]}
    rng = rank_state(step, rank if rank < WORLD else 0, WORLD)["rng"]
    return digests({"model": model, "rng": rng, "step": step})


def ask_all(ranks: list[TrainerRank], cmd: dict[str, Any], timeout: float = 90.0) -> list[dict[str, Any]]:
    """`cmd` to every rank at once (they work in parallel, as the ranks of a job do); their answers."""
    for rank in ranks:
        rank.send(cmd)
    return [rank.answer(timeout) for rank in ranks]


def save_all(ranks: list[TrainerRank], step: int) -> None:
    """Every rank stages `step` (in parallel across hosts), then every rank waits for its commit."""
    for answer in ask_all(ranks, {"op": "save", "step": step, "wait": None}):
        assert answer["ok"], answer
    for rank, answer in zip(ranks, ask_all(ranks, {"op": "wait", "step": step, "timeout": 60}), strict=True):
        assert answer == {"ok": True, "status": "committed", "path": answer["path"]}, (answer, rank.log_tail())


def assert_restores(restorers: list[TrainerRank], step: int) -> None:
    """Both ranks of a W=2 job restore their part of `step`, bit-exact."""
    for rank, answer in enumerate(ask_all(restorers, {"op": "restore"})):
        assert answer == {"ok": True, "step": step, "digests": expected(step, rank, 2)}, answer


def start_job(
    cluster: Cluster, run: str, **a_env: str
) -> tuple[list[TrainerRank], list[TrainerRank], list[TrainerRank]]:
    """A `dcs worker` on each of ha (with `a_env`) and hb, two W=4 ranks on each of them, and a W=2 job on hc (no
    worker) that restores; the ranks start while the workers come up. Returns ha's ranks, hb's ranks, hc's ranks."""
    a, b, c = (cluster.network.hosts[name] for name in ("ha", "hb", "hc"))
    workers = [cluster.spawn_worker(a, **a_env), cluster.spawn_worker(b)]
    ranks = cluster.start_trainers(run, WORLD, [(a, 0), (a, 1), (b, 2), (b, 3)])
    restorers = cluster.start_trainers(run, 2, [(c, 0), (c, 1)])
    for worker in workers:
        cluster.wait_worker(worker)
    return ranks[:2], ranks[2:], restorers


def staged_runs(host: SimulatedHost) -> set[str]:
    """Runs (`<run>.rank-0000r`) with a staging buffer in this host's /dev/shm (its staging directory there)."""
    found = (re.fullmatch(r"dcs-dcs-(.+)-\d+-[0-9a-f]+-\d+\.stage", name) for name in host.staging_files())
    return {match[1] for match in found if match}


@pytest.fixture
def events(cluster: Cluster) -> Iterator[TaskEvents]:
    events = TaskEvents(cluster.config).start()
    yield events
    events.stop()


@pytest.mark.slow
def test_w4_step_on_two_hosts_commits_once_every_rank_is_durable_and_restores_at_w2_on_a_third(
    cluster: Cluster, events: TaskEvents
) -> None:
    a, b, c = (cluster.add_host(name) for name in ("ha", "hb", "hc"))
    ranks_a, ranks_b, restorers = start_job(cluster, "xh")
    names = ask_all(ranks_a + ranks_b, {"op": "whoami"})
    assert [n["node"] for n in names] == ["ha", "ha", "hb", "hb"] == [n["hostname"] for n in names]

    save_all(ranks_a, 10)  # host a's ranks are durable, host b's have not saved yet: no step 10
    for answer in ask_all(restorers, {"op": "restore", "step": 10}):
        assert answer == {"ok": False, "error": answer["error"]}, answer
        assert answer["error"].startswith("CheckpointNotFound") and "only ranks [0, 1] committed it" in answer["error"]
    save_all(ranks_b, 10)
    assert_restores(restorers, 10)
    save_all(ranks_a + ranks_b, 20)
    assert_restores(restorers, 20)

    # each rank staged in its own host's /dev/shm, and each worker got only its own host's ranks' tasks
    assert staged_runs(a) == {"xh.rank-00000", "xh.rank-00001"}
    assert staged_runs(b) == {"xh.rank-00002", "xh.rank-00003"}
    assert staged_runs(c) == set()
    owners = {f"xh.rank-0000{r}": {"ha" if r < 2 else "hb"} for r in range(WORLD)}
    with contextlib.suppress(TimeoutError):  # events travel on their own: give the last ones a moment
        wait_for(lambda: events.hosts_by_run(COMMIT) == owners, timeout=10)
    assert events.hosts_by_run(PERSIST) == owners
    assert events.hosts_by_run(COMMIT) == owners


@pytest.mark.slow
def test_cutting_a_trainer_hosts_link_mid_persist_keeps_the_previous_complete_step(cluster: Cluster) -> None:
    a = cluster.add_host("ha")
    cluster.add_host("hb")
    cluster.add_host("hc")
    # host a's worker writes 128 KiB/s: each rank's ~256 KiB file takes ~2 s, so the cut lands mid-write
    ranks_a, ranks_b, restorers = start_job(cluster, "cut", DCS_PERSIST_THROTTLE_BYTES_PER_SECOND=str(128 * KiB))
    save_all(ranks_a + ranks_b, 10)

    save_all(ranks_b, 20)
    for answer in ask_all(ranks_a, {"op": "save", "step": 20, "wait": None}):
        assert answer["ok"], answer
    step_dirs = [Path(cluster.config.checkpoint.dir) / "cut" / f"rank-0000{r}" / "step-000000020" for r in (0, 1)]
    wait_for(lambda: all(list(d.glob(".*.tmp")) for d in step_dirs if d.exists()) and all(map(Path.exists, step_dirs)))
    a.link_down()
    try:
        for answer in ask_all(ranks_a, {"op": "wait", "step": 20, "timeout": CUT_WAIT}, timeout=60):
            assert not answer["ok"] and answer["error"].startswith("DCSTimeoutError"), answer
        # host a's bytes are written (shared storage), but its worker can neither confirm with the ledger that the
        # files are still open (a copy is renamed into place only then: workers/persist.py) nor record them: no
        # final file and no step 20
        assert not any((d / "model-00001-of-00001.safetensors").exists() for d in step_dirs)
        assert_restores(restorers, 10)
        assert "only ranks [2, 3] committed it" in restorers[0].ask({"op": "restore", "step": 20})["error"]
    finally:
        a.link_up()
    cluster.network.wait_link(a)
    # host a's worker delivers its unacknowledged persists again once it reconnects: step 20 then completes
    # on both of its ranks (all four parts durable, so it restores bit-exact) or on neither; never half
    outcome = ask_all(ranks_a, {"op": "wait", "step": 20, "timeout": 30}, timeout=90)
    committed = [answer["ok"] for answer in outcome]
    if all(committed):
        assert restorers[0].ask({"op": "restore", "step": 20})["digests"] == expected(20, 0, 2)
    else:
        assert not any(committed), outcome
        assert "only ranks [2, 3] committed it" in restorers[0].ask({"op": "restore", "step": 20})["error"]
    save_all(ranks_a + ranks_b, 30)  # the next save completes on every rank
    assert_restores(restorers, 30)


def test_a_trainer_whose_host_has_no_worker_fails_at_once(cluster: Cluster) -> None:
    a, c = cluster.add_host("ha"), cluster.add_host("hc")
    worker = cluster.spawn_worker(a)  # a worker in the cluster, none on host c
    trainer = cluster.start_trainer(c, "nowk", 0, 1)
    cluster.wait_worker(worker)
    started = time.monotonic()
    answer = trainer.ask({"op": "save", "step": 1, "wait": None})
    assert time.monotonic() - started < 5
    assert not answer["ok"]
    assert answer["error"].startswith("NoWorkerError: no live `dcs worker` serves queue 'dcs.node.hc'"), answer
    assert "start one on host 'hc'" in answer["error"]
    assert staged_runs(c) == set()  # refused before anything was staged


def test_a_worker_on_the_wrong_host_never_reads_another_hosts_staging(cluster: Cluster, events: TaskEvents) -> None:
    a, c = cluster.add_host("ha"), cluster.add_host("hc")
    worker = cluster.spawn_worker(a)
    # a misconfigured trainer on host c that names host a's queue: it stages in c's /dev/shm
    trainer = cluster.start_trainer(c, "wrong", 0, 1, DCS_NODE_NAME="ha")
    cluster.wait_worker(worker)
    started = time.monotonic()
    staged = trainer.ask({"op": "save", "step": 1, "wait": None})
    assert staged["ok"], staged
    answer = trainer.ask({"op": "wait", "step": 1, "timeout": 30})
    assert time.monotonic() - started < 10  # failed at once, not retried
    assert not answer["ok"] and answer["error"].startswith("CheckpointFailed"), answer
    assert "is not on host 'ha'" in answer["error"] and "staged it on another host" in answer["error"], answer
    assert staged_runs(c) == {"wrong"} and staged_runs(a) == set()
    assert events.hosts_by_run(PERSIST) == {"wrong": {"ha"}}
    wait_for(lambda: not Path(staged["step_dir"]).exists())  # the failed step's directory is removed
    assert not list(Path(cluster.config.checkpoint.dir).rglob("*.safetensors"))


def wait_for(predicate: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s")
        time.sleep(0.01)
