"""A weight-sync backend that cannot run here is refused at once, before anything is registered or any engine is
asked to join; a group that fails on the trainer's side and the engines' names both, blaming the right one.

Real coordinator, thread-pool `dcs worker` and `dcs receiver` processes (tests/distributed/sync_stack.py).
"""

from __future__ import annotations

import asyncio
import random
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from dcs_tasks.celery_app import TaskName
from dcs_tasks.client.engine import CheckpointEngineClient
from dcs_tasks.config import BackendType, DCSConfig
from dcs_tasks.errors import BackendUnavailable, ConfigError, GroupInitError
from dcs_tasks.sync.bootstrap_client import check_backend
from tests.distributed.sync_stack import SyncStack, alive_ranks, sync_stack
from tests.helpers.ports import free_port

pytestmark = [pytest.mark.integration, pytest.mark.distributed, pytest.mark.slow]
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here: NCCL is not refused")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def actor(stack: SyncStack, backend: BackendType | str, device_id: int | None = None) -> CheckpointEngineClient:
    """The original design's trainer client (role actor, rank 0), pushing a small model."""
    return CheckpointEngineClient(
        coordinator_url=stack.url,
        role="actor",
        rank=0,
        backend_type=backend,  # type: ignore[arg-type]  # a user may pass a plain string
        device_id=device_id,
        model=torch.nn.Linear(8, 8),
        model_name="tiny",
        config=stack.config,
    )


async def start_and_update(client: CheckpointEngineClient) -> None:
    await client.start()
    await client.update_weights_for_rollout(rollout_only=True)


def joins_in(stack: SyncStack) -> list[str]:
    """The weight-sync tasks the worker received (its INFO log has "Task <name>[<id>] received" for each)."""
    text = stack.worker.log_path.read_text(errors="replace")
    return [name.value for name in (TaskName.BOOTSTRAP_GROUP, TaskName.JOIN_ENGINE) if f"{name.value}[" in text]


@no_cuda
async def test_nccl_on_a_host_without_cuda_is_refused_before_any_engine_is_asked_to_join(
    dcs_config: DCSConfig, tmp_path: Path
) -> None:
    """The original design's client example with BackendType.NCCL, on this CPU host: it used to ask the engine
    to join, blame it ("rollout_0 could not join") and retry 3 times, each waiting out the group-init timeout."""
    config = dcs_config.model_copy(update={"group_init_timeout_seconds": 20.0, "retry_delay_seconds": 0.5})
    with sync_stack(config, tmp_path, receivers=1) as stack:
        before = stack.receivers[0].digest()
        client = actor(stack, BackendType.NCCL)
        started = time.monotonic()
        try:
            with pytest.raises(BackendUnavailable) as info:
                await asyncio.wait_for(start_and_update(client), 45)
        finally:
            await client.stop()
        elapsed = time.monotonic() - started
        message = str(info.value)
        assert "'nccl' cannot run here" in message and "no CUDA device" in message, message
        assert "BackendType.GLOO" in message, message
        assert isinstance(info.value, ConfigError) and info.value.member is None
        assert elapsed < 10.0, f"took {elapsed:.1f}s"  # the group-init timeout alone is 20 s
        assert joins_in(stack) == [], "a group was bootstrapped / an engine was asked to join"
        assert stack.receivers[0].digest() == before
        assert alive_ranks(stack.url, "actor", stack.config.token()) == set()  # nothing left registered


@needs_cuda
async def test_a_cuda_device_id_this_host_lacks_is_refused_before_any_engine_is_asked_to_join(
    dcs_config: DCSConfig, tmp_path: Path
) -> None:
    with sync_stack(dcs_config, tmp_path, receivers=1) as stack:
        client = actor(stack, BackendType.NCCL, device_id=torch.cuda.device_count())
        try:
            with pytest.raises(BackendUnavailable, match=f"device_id {torch.cuda.device_count()} does not exist"):
                await asyncio.wait_for(start_and_update(client), 45)
        finally:
            await client.stop()
        assert joins_in(stack) == []


@pytest.mark.parametrize("backend", [BackendType.TCP, "mpi"])
async def test_a_backend_dcs_does_not_broadcast_over_is_refused_at_start(
    backend: BackendType | str, dcs_config: DCSConfig
) -> None:
    """Refused before the client contacts anything: no coordinator listens at this URL."""
    name = getattr(backend, "value", backend)
    config = dcs_config.model_copy(update={"coordinator_url": f"http://127.0.0.1:{free_port()}"})
    kind: BackendType = backend  # type: ignore[assignment]  # a user may pass a plain string
    client = CheckpointEngineClient(role="actor", rank=0, backend_type=kind, model=torch.nn.Linear(8, 8), config=config)
    try:
        with pytest.raises(BackendUnavailable, match=f"backend '{name}' cannot carry weight updates"):
            await client.start()
    finally:
        await client.stop()


def test_device_ids_are_checked_against_the_devices_torch_reports() -> None:
    """The rule itself, given the facts torch would report on a GPU host (this one has none)."""
    assert check_backend("nccl", 1, cuda_devices=2, nccl_built=True) is BackendType.NCCL
    assert check_backend(BackendType.NCCL, None, cuda_devices=1, nccl_built=True) is BackendType.NCCL
    assert check_backend("gloo", 7, cuda_devices=0, nccl_built=False) is BackendType.GLOO  # gloo ignores it
    for device_id in (2, -1):
        with pytest.raises(BackendUnavailable, match=f"device_id {device_id} does not exist.*2 CUDA device"):
            check_backend(BackendType.NCCL, device_id, cuda_devices=2, nccl_built=True)
    with pytest.raises(BackendUnavailable, match="has no NCCL built in"):
        check_backend(BackendType.NCCL, 0, cuda_devices=2, nccl_built=False)


@contextmanager
def squatted_port() -> Iterator[int]:
    """A port listened on at 127.0.0.2 only: the worker's check (bind 127.0.0.1:port) finds it free, but the
    trainer's master store, which listens on every address, cannot bind it (EADDRINUSE).

    The port is drawn from 24000-31999: below the kernel's ephemeral range (32768-60999 by default), where the
    outgoing connections of the tests running beside this one take their local ports, and apart from the comm
    ranges tests configure (11000-11999, 20000-20999). An ephemeral port collided once: another test's connection
    held 127.0.0.1:port between the draw and the worker's check, which then found no free master port."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(24000, 32000)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe, socket.socket() as sock:
            try:
                probe.bind(("127.0.0.1", port))  # free where the worker looks
                probe.close()
                sock.bind(("127.0.0.2", port))
            except OSError:
                continue
            sock.listen()
            yield port
            return
    raise RuntimeError("no port in 24000-31999 was free on both 127.0.0.1 and 127.0.0.2")


async def test_a_group_failing_on_both_sides_names_the_trainers_reason_and_each_engines(
    dcs_config: DCSConfig, tmp_path: Path
) -> None:
    """The trainer's master cannot listen; the engine, finding no master, fails too. The engine's failure used to
    be the only one reported (and blamed): now both are, and the trainer is blamed."""
    with squatted_port() as port:
        config = dcs_config.model_copy(
            update={
                "comm_base_port": port,
                "comm_max_port": port,
                "group_init_timeout_seconds": 5.0,
                "max_retries": 0,
            }
        )
        with sync_stack(config, tmp_path, receivers=1) as stack:
            client = actor(stack, BackendType.GLOO)
            try:
                with pytest.raises(GroupInitError) as info:
                    await asyncio.wait_for(start_and_update(client), 60)
            finally:
                await client.stop()
            assert joins_in(stack) == [TaskName.BOOTSTRAP_GROUP.value, TaskName.JOIN_ENGINE.value]
    message = str(info.value)
    trainer, engine = message.find("trainer (rank 0): "), message.find("rollout_0 could not join")
    assert 0 <= trainer < engine, message  # the trainer's reason first, then the engine's
    assert "EADDRINUSE" in message or "address already in use" in message, message
    assert info.value.member is None, message  # the trainer is to blame, not the engine left without a master
