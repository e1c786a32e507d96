"""CheckpointEngineClient's checkpoint delegation (to dcs_tasks.checkpoint.Checkpointer) and create_client."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dcs_tasks.client.engine import create_client
from dcs_tasks.config import DCSConfig
from dcs_tasks.sync.receiving import tensor_sha256
from tests.distributed.sync_stack import alive_ranks, sync_stack

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
