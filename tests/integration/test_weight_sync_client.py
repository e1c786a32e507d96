"""CheckpointEngineClient's checkpoint delegation (to dcs_tasks.checkpoint.Checkpointer) and create_client."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
import torch

from dcs_tasks.client.engine import create_client
from dcs_tasks.config import DCSConfig
from dcs_tasks.sync.receiving import tensor_sha256
from tests.distributed.sync_stack import alive_ranks, auth_headers, sync_stack

pytestmark = [pytest.mark.integration, pytest.mark.slow]


async def test_client_saves_and_restores_its_model_through_the_checkpointer(
    dcs_config: DCSConfig, tmp_path: Path
) -> None:
    with sync_stack(dcs_config, tmp_path) as stack:
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        client = await create_client(
            coordinator_url=stack.url, role="actor", rank=0, model=model, model_name="ckpt-run", config=stack.config
        )
        try:
            assert client.is_registered and client.node_id == "actor_0"
            assert alive_ranks(stack.url, "actor") == {0}
            saved = {n: tensor_sha256(t) for n, t in model.state_dict().items()}
            client.save_checkpoint(step=1).wait(timeout=60)
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()
            restored = client.load_checkpoint()
            assert restored.step == 1
            assert {n: tensor_sha256(t) for n, t in model.state_dict().items()} == saved
        finally:
            await client.stop()


async def test_is_registered_turns_false_when_another_node_takes_the_rank(
    dcs_config: DCSConfig, tmp_path: Path
) -> None:
    import asyncio

    from dcs_tasks.config import RoleInfo
    from dcs_tasks.coordinator_api import CoordinatorAPI

    # a register takes a live node's rank over only with fencing off (DCS_NODE_IDENTITY_REQUIRED=false); with
    # it on, the default, the register is refused instead (tests/integration/test_coordinator_fencing.py)
    legacy = dcs_config.model_copy(update={"node_identity_required": False})
    with sync_stack(legacy, tmp_path) as stack:
        client = await create_client(coordinator_url=stack.url, role="actor", rank=0, model={}, config=stack.config)
        try:
            assert client.is_registered
            async with CoordinatorAPI(stack.url, timeout=10) as other:
                await other.register(RoleInfo(role_name="actor", rank=0, ip="10.9.9.9", port=1))  # the new owner
            for _ in range(100):  # heartbeats every 0.5 s: the next one is fenced off (409)
                if not client.is_registered:
                    break
                await asyncio.sleep(0.1)
            assert not client.is_registered
        finally:
            await client.stop()
        # its stop() does not remove the node that holds the rank now (the unregister is fenced, or not sent)
        async with CoordinatorAPI(stack.url, timeout=10) as reader:
            holder = (await reader.debug_topology()).nodes["actor"][0]
        assert holder.info.ip == "10.9.9.9", holder


async def test_updates_hold_the_seed_lock_and_world_size_is_kept(dcs_config: DCSConfig, tmp_path: Path) -> None:
    import asyncio
    import threading

    from dcs_tasks.errors import DCSTimeoutError

    lock = threading.Lock()
    config = dcs_config.model_copy(update={"comm_timeout_seconds": 1.0})
    with sync_stack(config, tmp_path) as stack:
        client = await create_client(
            coordinator_url=stack.url, role="actor", rank=0, model={}, config=stack.config, lock=lock, world_size=4
        )
        try:
            assert client.world_size == 4
            lock.acquire()  # another updater holds it
            update = asyncio.create_task(client.update_weights_for_rollout(rollout_only=True))
            await asyncio.sleep(0.3)
            assert not update.done()
            lock.release()
            assert (await asyncio.wait_for(update, 10))["rollout"]["engines"] == 0  # no engines registered
            assert lock.acquire(timeout=1)  # released after the update
            with pytest.raises(DCSTimeoutError, match="lock was not free within 1s"):
                await client.update_weights_for_rollout(rollout_only=True)
            lock.release()
        finally:
            await client.stop()


def debug_ranks(url: str, role: str, token: str | None) -> set[int]:
    """The ranks of `role` /debug/topology lists: live and dead nodes (until the dead-node sweep)."""
    answer = httpx.get(f"{url}/debug/topology", headers=auth_headers(token), timeout=10).json()
    return {int(r) for r in answer["nodes"].get(role, {})}


async def test_stop_unregisters_the_node_at_once_and_twice_is_fine(dcs_config: DCSConfig, tmp_path: Path) -> None:
    """A cleanly stopped trainer leaves the topology when it stops, not a heartbeat timeout later (and stays in
    /debug/topology until the dead-node sweep, an hour by default, unless it unregisters)."""
    with sync_stack(dcs_config, tmp_path) as stack:
        token = stack.config.token()
        client = await create_client(coordinator_url=stack.url, role="actor", rank=0, model={}, config=stack.config)
        try:
            assert alive_ranks(stack.url, "actor", token) == {0} == debug_ranks(stack.url, "actor", token)
        finally:
            await client.stop()
        # read at once: the heartbeat timeout (2 s here) has not run out, so only the unregister removed it
        assert alive_ranks(stack.url, "actor", token) == set()
        assert debug_ranks(stack.url, "actor", token) == set()
        await client.stop()  # again: nothing to do, nothing raised
        assert not client.is_registered
        # the rank is free at once: a restarted trainer takes it back without waiting out a predecessor
        again = await create_client(coordinator_url=stack.url, role="actor", rank=0, model={}, config=stack.config)
        try:
            assert again.rank == 0 and alive_ranks(stack.url, "actor", token) == {0}
        finally:
            await again.stop()


async def test_stop_with_a_frozen_coordinator_logs_and_returns_within_the_request_timeout(
    dcs_config: DCSConfig, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The coordinator accepts connections but does not answer (SIGSTOP): stop() gives the unregister
    `request_timeout_seconds`, logs that it failed and closes the rest; it neither hangs nor raises."""
    with sync_stack(dcs_config, tmp_path) as stack:
        config = stack.config.model_copy(update={"request_timeout_seconds": 2.0})
        client = await create_client(coordinator_url=stack.url, role="actor", rank=0, model={}, config=config)
        assert stack.coordinator.proc is not None
        group = stack.coordinator.proc.pid  # its own session: the process group of every coordinator process
        os.killpg(group, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with caplog.at_level(logging.WARNING, logger="dcs_tasks.client.engine"):
                await asyncio.wait_for(client.stop(), 30)
            elapsed = time.monotonic() - started
        finally:
            os.killpg(group, signal.SIGCONT)
        assert 1.5 <= elapsed < 8.0, f"stop() took {elapsed:.1f}s with a 2 s request timeout"
        assert "unregistering actor_0 failed (its heartbeats will expire)" in caplog.text, caplog.text
