"""kill -9 of the `dcs worker` running `bootstrap_group`, with real processes (coordinator, worker, `dcs receiver`).

The first worker is slowed from outside (tests/faults/paused_bootstrap_worker.py wraps its port reservation):
it pauses after the group's epoch and master port are reserved, before any join is sent, and is killed there.
A second worker takes the task back at start (workers/recovery.py). The redelivered bootstrap must form the
same group: the same epoch and the one port reserved for it (none leaked), one join sent to the receiver (a
second `/init_weights_update_group` would re-initialise an engine's group), the update bit-exact, the record
READY; after the trainer's teardown the record says DESTROYED and the port is free.
"""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import pytest
import redis
import torch

from dcs_tasks.celery_app import TaskName, make_celery, node_queue
from dcs_tasks.client.engine import CheckpointEngineClient
from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import GroupInitError
from dcs_tasks.keys import Keys
from dcs_tasks.sync.group_bootstrap import (
    GroupAlreadyDestroyed,
    abandon_bootstrap,
    bootstrap,
    bootstrap_ttl,
    destroy_group,
    port_binds,
)
from dcs_tasks.sync.receiving import tensor_sha256
from dcs_tasks.sync.wire import BootstrapRequest, DestroyRequest, EngineEndpoint, GroupPlan, JoinRequest
from tests.distributed.sync_stack import ReceiverProcess
from tests.faults.paused_bootstrap_worker import PAUSE_SECONDS_ENV
from tests.helpers.procs import CoordinatorProcess, WorkerProcess

pytestmark = [pytest.mark.integration, pytest.mark.distributed, pytest.mark.slow]

GROUP_PREFIX = "tiny-actor0"  # CheckpointEngineClient's prefix: model name, role and rank


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 8)
        self.b = torch.nn.Parameter(torch.randn(3, 5, dtype=torch.float64))


def free_port_block(n: int) -> int:
    """A master-port range of `n` ports that bind now (ports are host-wide; Redis reservations are per test)."""
    for start in range(41000, 61000, n):
        if all(port_binds("127.0.0.1", p) for p in range(start, start + n)):
            return start
    raise RuntimeError("no free block of ports")


def reservations(client: redis.Redis, keys: Keys, host: str) -> dict[str, str]:
    """Every master-port reservation key of `host` -> the group it names."""
    found = client.keys(keys.port_reservation(host, "*"))
    return {key: client.get(key) for key in found}


def nothing_listens(port: int) -> bool:
    """Whether a listener could bind the port, TIME_WAIT connections allowed (SO_REUSEADDR)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def wait_until(what: str, check: object, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"{what} not seen within {timeout:g}s"
        time.sleep(0.05)


async def test_worker_killed_in_bootstrap_redelivers_the_same_group(dcs_config: DCSConfig, tmp_path: Path) -> None:
    base = free_port_block(8)
    config = dcs_config.model_copy(
        update={
            "comm_base_port": base,
            "comm_max_port": base + 7,
            "group_init_timeout_seconds": 40.0,
            "max_retries": 0,  # one attempt: a second epoch could only come from the redelivery
            "retry_delay_seconds": 0.2,
        }
    )
    client = redis.Redis.from_url(config.redis.url, decode_responses=True)
    keys = Keys(config.redis.namespace)
    host = config.host_name
    coordinator = CoordinatorProcess(config, tmp_path / "coordinator.log").start()
    config = config.model_copy(update={"coordinator_url": coordinator.url})
    slow = WorkerProcess(
        config,
        tmp_path / "worker1.log",
        concurrency=4,
        pool="threads",
        env={PAUSE_SECONDS_ENV: "120"},
        module="tests.faults.paused_bootstrap_worker",
    )
    fresh = WorkerProcess(config, tmp_path / "worker2.log", concurrency=4, pool="threads")
    receiver = ReceiverProcess(config, coordinator.url, 0, tmp_path / "receiver.log")
    trainer: CheckpointEngineClient | None = None
    try:
        await asyncio.gather(asyncio.to_thread(slow.start), asyncio.to_thread(receiver.start))  # together: faster
        model = Tiny()
        trainer = CheckpointEngineClient(
            coordinator_url=coordinator.url, role="actor", rank=0, model=model, model_name="tiny", config=config
        )
        await trainer.start()
        update = asyncio.create_task(trainer.update_weights_for_rollout(rollout_only=True))

        # the bootstrap has reserved the group's port and pauses before its joins: kill the worker there
        await asyncio.to_thread(wait_until, "a port reservation", lambda: reservations(client, keys, host), 30.0)
        assert "reserved: pausing" in slow.log_tail(10**6)
        assert not update.done()
        slow.kill()
        # the dead worker's presence key stays until its TTL (5 s) runs out; removed here, as that expiry would
        # (the new worker's start-up recovery finds no live worker either way), the key fresh.start() waits for
        # is the new worker's own
        client.delete(keys.worker_presence(node_queue(host)))
        fresh.start()

        metrics = (await asyncio.wait_for(update, timeout=60))["rollout"]
        group = metrics["group_name"]
        assert group == f"{GROUP_PREFIX}-e1"  # the redelivery drew no second epoch
        assert client.get(keys.group_epoch(GROUP_PREFIX)) == "1"
        record = client.hgetall(keys.group(group))
        port = int(record["master_port"])
        # one port reserved for the group epoch, the one the engines were told; none leaked
        assert reservations(client, keys, host) == {keys.port_reservation(host, port): group}
        assert record["status"] == "ready"
        assert client.ttl(keys.port_reservation(host, port)) > bootstrap_ttl(config)  # READY: the long backstop
        # the bootstrap really ran twice: once in the killed worker, once redelivered to the new one
        assert client.get(keys.task_deliveries(f"{record['request_id']}:0")) == "2"
        assert "restored 1 task(s)" in fresh.log_tail(10**6)
        # one join, sent once, under the id the bootstrap result named
        claims = client.keys(keys.join_claim("*"))
        assert claims == [keys.join_claim(record["join:rollout_0"])]
        assert '"success":true' in client.get(claims[0]).replace(" ", "")
        digest = receiver.digest()
        assert digest.weight_version == 1
        assert digest.tensors == {name: tensor_sha256(t) for name, t in model.state_dict().items()}

        await trainer.stop()  # drops the group: its teardown task runs on the new worker
        trainer = None
        key = keys.group(group)
        await asyncio.to_thread(wait_until, "DESTROYED", lambda: client.hget(key, "status") == "destroyed", 30.0)
        assert reservations(client, keys, host) == {}
        assert nothing_listens(port)  # the trainer's store is closed: only TIME_WAIT may be left
    finally:
        if trainer is not None:
            await trainer.stop()
        receiver.stop()
        slow.kill()
        fresh.discard()
        coordinator.stop()


def _request(request_id: str, engines: int = 2) -> BootstrapRequest:
    members = tuple(EngineEndpoint(rank=r, ip="127.0.0.1", port=9, rank_offset=1 + r) for r in range(engines))
    plan = GroupPlan(world_size=1 + engines, engines=members)
    return BootstrapRequest(group_prefix="m-actor0", master_address="127.0.0.1", plan=plan, request_id=request_id)


def test_a_bootstrap_delivered_again_returns_the_same_group_and_sends_no_join_twice(dcs_config: DCSConfig) -> None:
    base = free_port_block(4)
    config = dcs_config.model_copy(update={"comm_base_port": base, "comm_max_port": base + 3})
    client = redis.Redis.from_url(config.redis.url, decode_responses=True)
    keys, host = Keys(config.redis.namespace), config.host_name
    sent: list[tuple[str, JoinRequest]] = []

    def send(task_id: str, join: JoinRequest) -> None:
        sent.append((task_id, join))

    first = bootstrap(client, keys, config, _request("req-1"), "req-1", send)
    again = bootstrap(client, keys, config, _request("req-1"), "req-1", send)
    assert again == first and first.epoch == 1 and first.master_port == base
    assert [task_id for task_id, _ in sent] == first.join_task_ids  # one join per engine, not two
    assert {join.body.master_port for _, join in sent} == {base}
    assert reservations(client, keys, host) == {keys.port_reservation(host, base): first.group_name}

    other = bootstrap(client, keys, config, _request("req-2", engines=0), "req-2", send)
    assert other.epoch == 2 and other.master_port == base + 1
    assert client.hget(keys.group(other.group_name), "status") == "ready"  # no engines: formed at once


class Killed(BaseException):
    """Stands for the kill -9 of the worker at the point where it is raised."""


def test_a_delivery_killed_before_checking_its_port_leaves_it_to_the_next(
    dcs_config: DCSConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = free_port_block(3)
    config = dcs_config.model_copy(update={"comm_base_port": base, "comm_max_port": base + 2})
    client = redis.Redis.from_url(config.redis.url, decode_responses=True)
    keys, host = Keys(config.redis.namespace), config.host_name
    sent: list[JoinRequest] = []

    def killed(address: str, port: int) -> bool:
        raise Killed

    monkeypatch.setattr("dcs_tasks.sync.group_bootstrap.port_binds", killed)
    with pytest.raises(Killed):  # reserved and recorded, not yet checked, no join sent
        bootstrap(client, keys, config, _request("req-1"), "req-1", lambda _id, join: sent.append(join))
    monkeypatch.undo()
    assert client.hmget(keys.group("m-actor0-e1"), ["master_port", "port_checked"]) == [str(base), "0"]
    with socket.socket() as busy:  # meanwhile something else took the port
        busy.bind(("127.0.0.1", base))
        result = bootstrap(client, keys, config, _request("req-1"), "req-1", lambda _id, join: sent.append(join))
    assert result.epoch == 1 and result.master_port == base + 1
    assert {join.body.master_port for join in sent} == {base + 1} and len(sent) == 2
    assert reservations(client, keys, host) == {keys.port_reservation(host, base + 1): result.group_name}


def test_destroy_ends_the_lifecycle_once_and_a_failed_bootstrap_is_destroyed(dcs_config: DCSConfig) -> None:
    base = free_port_block(2)
    config = dcs_config.model_copy(update={"comm_base_port": base, "comm_max_port": base + 1})
    client = redis.Redis.from_url(config.redis.url, decode_responses=True)
    keys, host = Keys(config.redis.namespace), config.host_name
    group = bootstrap(client, keys, config, _request("req-1", engines=1), "req-1", lambda *_: None)
    record = keys.group(group.group_name)
    assert client.hget(record, "status") == "bootstrapping"
    assert client.ttl(record) <= bootstrap_ttl(config)  # a bootstrap nobody finishes goes by itself

    engines = list(_request("req-1", engines=1).plan.engines)  # port 9: nothing answers
    teardown = DestroyRequest(group_name=group.group_name, host=host, master_port=group.master_port, engines=engines)
    destroy_group(client, keys, teardown, timeout=2.0)
    assert client.hget(record, "status") == "destroyed"
    assert reservations(client, keys, host) == {}
    with pytest.raises(GroupAlreadyDestroyed):  # a late redelivery of its bootstrap forms nothing
        bootstrap(client, keys, config, _request("req-1", engines=1), "req-1", lambda *_: None)
    assert reservations(client, keys, host) == {}

    failed = bootstrap(client, keys, config, _request("req-2", engines=1), "req-2", lambda *_: None)
    assert abandon_bootstrap(client, keys, host, "req-2", "m-actor0", "boom") == failed.group_name
    assert client.hgetall(keys.group(failed.group_name))["destroy_reason"] == "bootstrap failed: boom"
    assert reservations(client, keys, host) == {}


async def test_a_bootstrap_the_trainer_gave_up_on_is_dropped_not_run(dcs_config: DCSConfig, tmp_path: Path) -> None:
    """No worker while the trainer waits: its bootstrap expires with the wait, so the worker started later
    drops it (no epoch drawn, no port reserved, no join sent) instead of forming a group nobody uses."""
    config = dcs_config.model_copy(update={"group_init_timeout_seconds": 3.0, "max_retries": 0})
    client = redis.Redis.from_url(config.redis.url, decode_responses=True)
    keys, host = Keys(config.redis.namespace), config.host_name
    coordinator = CoordinatorProcess(config, tmp_path / "coordinator.log").start()
    config = config.model_copy(update={"coordinator_url": coordinator.url})
    receiver = ReceiverProcess(config, coordinator.url, 0, tmp_path / "receiver.log")
    late = WorkerProcess(config, tmp_path / "worker.log", concurrency=2, pool="threads")
    trainer = CheckpointEngineClient(
        coordinator_url=coordinator.url, role="actor", rank=0, model=Tiny(), model_name="tiny", config=config
    )
    try:
        await asyncio.gather(asyncio.to_thread(receiver.start), trainer.start())
        with pytest.raises(GroupInitError, match="no `dcs worker`"):
            await trainer.update_weights_for_rollout(rollout_only=True)
        late.start()
        queue = node_queue(host)
        ping = make_celery(config).send_task(TaskName.PING.value, queue=queue)  # queued behind the bootstrap
        await asyncio.to_thread(ping.get, timeout=30)
        assert "Discarding revoked task: dcs.sync.bootstrap_group" in late.log_tail(10**6)  # expired
        assert client.get(keys.group_epoch(GROUP_PREFIX)) is None
        assert reservations(client, keys, host) == {}
        assert client.keys(keys.join_claim("*")) == []
    finally:
        await trainer.stop()
        receiver.stop()
        late.discard()
        coordinator.stop()
