"""Redis high availability: a real `dcs coordinator`, a real `dcs worker` and a trainer (this process) all on a
Sentinel URL; the Redis master is killed with -9 while a save is in flight (docs/operations.md, "Redis high
availability (Sentinel)"). Nothing DCS runs is restarted: the clients follow the promoted replica."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import torch

from dcs_tasks.celery_app import node_queue
from dcs_tasks.checkpoint import Checkpointer
from dcs_tasks.checkpoint.format.layout import step_dir_name
from dcs_tasks.checkpoint.pending import FINAL
from dcs_tasks.checkpoint.store.ledger.stepledger import StepLedger, StepStatus
from dcs_tasks.config import DCSConfig, RoleInfo
from dcs_tasks.coordinator_api import CoordinatorAPI
from dcs_tasks.errors import CheckpointFailed, CoordinatorError, DCSTimeoutError
from dcs_tasks.heartbeats import HeartbeatLoop
from dcs_tasks.keys import Keys
from dcs_tasks.models import TopologyResponse, WeightMeta
from dcs_tasks.redisconn import sync_client
from tests.checkpoint_support import ckpt_config, training_state, wait_until
from tests.helpers.procs import CoordinatorProcess, WorkerProcess
from tests.helpers.sentinel import SentinelCluster
from tests.helpers.waiting import eventually

pytestmark = [pytest.mark.integration, pytest.mark.slow]
META = WeightMeta(names=["w"], dtypes=["float32"], shapes=[[2]], group_name="g")
IN_FLIGHT_TIMEOUT = 25.0  # > visibility timeout + kombu's restore scan: a task cancelled by the failover returns


@pytest.fixture
def sentinel_cluster(tmp_path: Path) -> Iterator[SentinelCluster]:
    cluster = SentinelCluster(tmp_path / "sentinel").start()
    yield cluster
    cluster.stop()


@pytest.fixture
def ha_config(sentinel_cluster: SentinelCluster, tmp_path: Path) -> DCSConfig:
    base = DCSConfig(
        redis_url=sentinel_cluster.url,
        checkpoint_dir=tmp_path / "ckpt",
        heartbeat_interval_seconds=0.5,
        heartbeat_timeout_seconds=3.0,
        node_name="testhost",
        enable_metrics=False,
        redis_socket_timeout_seconds=2.0,
    )
    # short limits so a persist task cancelled by the connection loss comes back within the test, and a short
    # bound on a wedged stop after kombu's failover crash (the worker re-execs itself then; 15 s by default)
    limits = {"task_soft_time_limit_seconds": 5.0, "task_time_limit_seconds": 6.0, "visibility_timeout_seconds": 8.0}
    return ckpt_config(base, tmp_path, **limits, worker_stuck_stop_seconds=4.0)


@pytest.fixture
async def stack(ha_config: DCSConfig, tmp_path: Path) -> AsyncIterator[tuple[CoordinatorProcess, WorkerProcess]]:
    # both start at once (each is a Python process importing its stack: seconds on a loaded machine)
    coordinator, worker = await asyncio.gather(
        asyncio.to_thread(CoordinatorProcess(ha_config, tmp_path / "coordinator.log").start),
        asyncio.to_thread(WorkerProcess(ha_config, tmp_path / "worker.log").start),
    )
    yield coordinator, worker
    worker.discard()  # the test looked at everything it needs from it; no warm shutdown (~3 s)
    coordinator.stop()


async def _all_alive(api: CoordinatorAPI, want: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            health = await api.health()
            if health.world_size == want and not health.dead_nodes:
                return
        except Exception:  # 503 while Redis fails over
            pass
        await asyncio.sleep(0.2)
    raise AssertionError(f"{want} nodes not all alive within {timeout}s")


async def _topology(api: CoordinatorAPI, timeout: float, actors: list[int]) -> TopologyResponse:
    """The topology once its live actors are `actors`, or the last one read at `timeout`. The nodes' records
    survive a failover, but a heartbeat key (TTL: the heartbeat timeout) may run out while Redis fails over
    and the first beats after it are retried: such a node is back, with its record, at its next beat."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            topo = await api.topology()
            if sorted(topo.nodes.get("actor", {})) == actors or time.monotonic() > deadline:
                return topo
        except CoordinatorError:
            if time.monotonic() > deadline:
                raise
        await asyncio.sleep(0.2)


def _commits_written(config: DCSConfig) -> list[int]:
    """The step of every commit task whose recorded result is 'write' (this call committed the step), from
    Celery's result backend (results are extended: they keep the task's arguments). A result stored on the old
    master just before the kill can be lost with it (the step is then committed on disk while its 'write'
    result is gone, and a redelivered commit finds it done), so callers compare these with the committed steps
    as a subset, and check that no step was committed twice."""
    client = sync_client(config)
    steps = []
    for key in client.scan_iter("celery-task-meta-*"):
        meta = json.loads(client.get(key) or "{}")
        if meta.get("name") == "dcs.ckpt.commit" and meta.get("result") == "write":
            steps.append(int(meta["args"][0]["ref"]["step"]))
    return sorted(steps)


def _diagnostics(config: DCSConfig, worker: WorkerProcess) -> str:
    """What a failed wait after the failover needs to be understood: the ledger, the queues and the worker's log."""
    client = sync_client(config)
    book = StepLedger(client, Keys(config.redis.namespace))
    ledger = {step: getattr(book.read("ha", step), "status", None) for step in (1, 2, 3)}
    queues = {key: client.llen(key) for key in client.scan_iter("dcs.*") if client.type(key) == "list"}
    unacked = client.hlen("unacked") if client.exists("unacked") else 0
    return f"ledger {ledger}; queue lengths {queues}; unacked {unacked}\n{worker.log_tail(20_000)}"


def _task_messages(config: DCSConfig) -> int:
    """The task messages Redis still holds: queued (kombu's lists of the `dcs.*` queues) or delivered and not
    acknowledged yet (its `unacked` hash: a worker runs it, or kombu restores it later; tasks are late-ack)."""
    client = sync_client(config, socket_timeout=2)
    try:
        lists = [key for key in client.scan_iter("dcs.*") if client.type(key) == "list"]
        return sum(int(client.llen(key)) for key in lists) + int(client.hlen("unacked"))
    finally:
        client.close()


def _close_wait(config: DCSConfig, in_flight: object, limit: float) -> float:
    """The timeout for `ckpt.close()`: `limit` (close waits for the in-flight save to end) while a task message
    that could still commit it exists; 0 once its save is final (close has nothing to wait for) or once Redis holds
    no task message at two looks 0.5 s apart (no task of the save can run any more: waiting would only run out)."""
    deadline = time.monotonic() + limit
    empty_looks = 0
    while time.monotonic() < deadline:
        if in_flight.poll() in FINAL:  # type: ignore[attr-defined]
            return limit
        empty_looks = empty_looks + 1 if _task_messages(config) == 0 else 0
        if empty_looks == 2:
            return 0.0
        time.sleep(0.5)
    return 0.0


def _kill_when(cluster: SentinelCluster, worker: WorkerProcess, moment: str) -> int:
    """kill -9 the master at once ('dispatch': the persist tasks are being sent) or once the worker took the
    save's persist task ('persisting': the task is running when Redis goes)."""
    if moment == "persisting":
        deadline = time.monotonic() + 20
        while worker.log_tail(1_000_000).count("dcs.ckpt.persist[") < 4 and time.monotonic() < deadline:
            time.sleep(0.005)  # step 1's task was received and succeeded (2 lines); wait for step 2's
    return cluster.kill_master()


def _wait_in_flight(pending: object) -> tuple[str, float]:
    """The in-flight save's outcome: committed, or one of the named errors, within its timeout."""
    started = time.monotonic()
    try:
        pending.wait(IN_FLIGHT_TIMEOUT)  # type: ignore[attr-defined]
        outcome = "committed"
    except (CheckpointFailed, DCSTimeoutError) as exc:
        outcome = type(exc).__name__
    return outcome, time.monotonic() - started


@pytest.mark.parametrize("moment", ["dispatch", "persisting"])
async def test_master_killed_mid_save_failover_keeps_state_and_everything_resumes(
    sentinel_cluster: SentinelCluster,
    ha_config: DCSConfig,
    stack: tuple[CoordinatorProcess, WorkerProcess],
    moment: str,
) -> None:
    coordinator, worker = stack
    state = training_state()
    big = {"weights": torch.randn(48 * 1024 * 1024 // 4), "step": 2}  # 48 MiB: its persist takes a while
    ckpt = Checkpointer("ha", ha_config)
    async with CoordinatorAPI(coordinator.url, timeout=5) as api:
        nodes = [await api.register(RoleInfo(role_name="actor", port=4000 + i)) for i in range(2)]
        loops = [
            HeartbeatLoop(api, RoleInfo(role_name="actor", port=4000 + n.rank, rank=n.rank), 0.5).start() for n in nodes
        ]
        first = await asyncio.to_thread(lambda: ckpt.save(state, step=1).wait(30))
        assert first.step == 1
        await api.send_weight_meta(META)
        assert sentinel_cluster.wait_replicated() == 1  # everything acknowledged so far is on the replica

        in_flight = await asyncio.to_thread(ckpt.save, big if moment == "persisting" else state, 2)
        old = await asyncio.to_thread(_kill_when, sentinel_cluster, worker, moment)
        killed_at = time.monotonic()
        new = await asyncio.to_thread(sentinel_cluster.wait_promoted, old)
        failover_s = time.monotonic() - killed_at
        assert new != old

        outcome, waited = await asyncio.to_thread(_wait_in_flight, in_flight)
        assert waited < IN_FLIGHT_TIMEOUT + 5

        # topology and the committed ledger survived on the promoted replica
        topo = await _topology(api, timeout=15, actors=[0, 1])
        assert sorted(topo.nodes["actor"]) == [0, 1]
        book = StepLedger(sync_client(ha_config), Keys(ha_config.redis.namespace))
        assert book.read("ha", 1).status is StepStatus.COMMITTED
        step2_after_failover = book.read("ha", 2).status  # None: the save's begin was lost with the old master

        # heartbeats resume through the same coordinator process and the same client
        beats_before = [loop.beats for loop in loops]
        await _all_alive(api, 2, timeout=15)
        await eventually(
            lambda: all(loop.beats > before for loop, before in zip(loops, beats_before, strict=True)),
            10,
            "a heartbeat of every loop after the failover",
        )
        assert all(loop.lost is None for loop in loops)

        # weight meta survived, and a long-poll is woken through the resubscribed notifier on the new master
        assert (await api.recv_weight_meta(0)).entries == [META]
        poll = asyncio.create_task(api.recv_weight_meta(1, wait_timeout_s=10))
        await asyncio.sleep(0.5)
        await api.send_weight_meta(WeightMeta.end())
        assert (await asyncio.wait_for(poll, 5)).entries == [WeightMeta.end()]

        # a new save after the failover commits, through the same worker process. The worker may still be
        # restarting after kombu's crash on the failover (bounded by its stuck-stop watchdog): wait, bounded, for
        # its presence on the new master, which a save checks first
        def worker_present() -> bool:
            client = sync_client(ha_config, socket_timeout=2)
            try:
                return bool(
                    client.exists(Keys(ha_config.redis.namespace).worker_presence(node_queue(ha_config.host_name)))
                )
            finally:
                client.close()

        await asyncio.to_thread(wait_until, worker_present, 45, "the worker serving its queue on the new master")
        try:
            third = await asyncio.to_thread(lambda: ckpt.save(state, step=3).wait(45))
        except DCSTimeoutError as exc:
            raise AssertionError(f"{exc}\n{await asyncio.to_thread(_diagnostics, ha_config, worker)}") from exc
        assert third.step == 3
        for loop in loops:
            await loop.stop()
    ckpt.close(await asyncio.to_thread(_close_wait, ha_config, in_flight, 10))

    committed = sorted(info.step for info in ckpt.list())
    assert {1, 3} <= set(committed)
    if outcome != "DCSTimeoutError":  # a timed-out save may still commit later, once
        assert (2 in committed) == (outcome == "committed"), (outcome, committed)
    for step in committed:  # each committed step has its manifest, written by exactly one commit task
        assert (Path(ha_config.checkpoint.dir) / "ha" / step_dir_name(step) / "manifest.json").is_file()
    written = _commits_written(ha_config)
    assert len(written) == len(set(written)), (written, worker.log_tail())  # no step committed twice
    assert set(written) <= set(committed), (written, committed)
    # nothing was restarted from outside: the coordinator and the worker are the processes started above.
    # Known limit (docs/operations.md): when a task is unacked at the kill, kombu 5.7's consumer crashes while
    # restoring it on the dead connection and `dcs worker` re-executes itself in place (same pid, workers/cli.py)
    assert coordinator.proc is not None and coordinator.proc.poll() is None
    assert worker.proc is not None and worker.proc.poll() is None
    reexecs = worker.log_tail(1_000_000).count("worker stopped without a shutdown signal")
    assert reexecs <= 1, worker.log_tail()
    print(f"{moment}: failover {failover_s:.1f}s; in-flight save {outcome} after {waited:.1f}s; committed {committed}")
    print(f"{moment}: step 2 in the ledger right after the failover: {step2_after_failover}")
    print(f"{moment}: worker re-executed itself {reexecs} time(s)")


async def test_password_protected_sentinel_deployment_serves_every_dcs_client(tmp_path: Path) -> None:
    """Master and replica with requirepass, sentinels with a password of their own: the coordinator, the
    worker (Celery broker and result backend through kombu's Sentinel transport) and a trainer all work with
    `sentinel://:pw@.../master/0?sentinel_password=...`, and neither password reaches a log."""
    cluster = SentinelCluster(tmp_path / "sentinel", password="data-pw-7", sentinel_password="sent-pw-9").start()
    try:
        base = DCSConfig(
            redis_url=cluster.url, checkpoint_dir=tmp_path / "ckpt", node_name="testhost", enable_metrics=False
        )
        config = ckpt_config(base, tmp_path)
        coordinator, worker = await asyncio.gather(
            asyncio.to_thread(CoordinatorProcess(config, tmp_path / "coordinator.log").start),
            asyncio.to_thread(WorkerProcess(config, tmp_path / "worker.log").start),
        )
        try:
            async with CoordinatorAPI(coordinator.url, timeout=5) as api:
                assert (await api.register(RoleInfo(role_name="actor", port=4000))).rank == 0
                assert (await api.health()).world_size == 1
            with Checkpointer("pw", config) as ckpt:
                info = await asyncio.to_thread(lambda: ckpt.save(training_state(), step=1).wait(30))
            assert info.step == 1
            assert cluster.master().exists(Keys(config.redis.namespace).worker_presence("dcs.node.testhost"))
        finally:
            await asyncio.to_thread(worker.terminate)
            coordinator.stop()
        logs = worker.log_tail(1_000_000) + coordinator.log_tail(1_000_000)
        assert "data-pw-7" not in logs and "sent-pw-9" not in logs
        assert "sentinel://:**@127.0.0.1" in worker.log_tail(1_000_000)  # Celery's banner, masked
    finally:
        cluster.stop()
