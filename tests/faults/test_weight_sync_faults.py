"""Weight-sync faults with real processes: a receiver killed mid-update, an engine that cannot join."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest
import torch

from dcs_tasks.client.engine import CheckpointEngineClient
from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import GroupInitError, WeightSyncError
from dcs_tasks.sync.receiving import tensor_sha256
from tests.distributed.sync_stack import ReceiverProcess, sync_stack, wait_registered

pytestmark = [pytest.mark.integration, pytest.mark.distributed, pytest.mark.slow]


class Many(torch.nn.Module):
    """200 tensors of 64 KiB: with 64 KiB buckets an update takes 200 HTTP-announced broadcasts."""

    def __init__(self) -> None:
        super().__init__()
        self.params = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(16384)) for _ in range(200))


def digest_of(model: torch.nn.Module) -> dict[str, str]:
    return {name: tensor_sha256(t) for name, t in model.state_dict().items()}


def wait_for_log(receiver: ReceiverProcess, needle: str, count: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while receiver.log_tail(10**7).count(needle) < count:
        assert time.monotonic() < deadline, f"{needle!r} x{count} not logged; log: {receiver.log_tail()}"
        time.sleep(0.01)


async def test_receiver_killed_mid_update_fails_fast_then_survivors_update(
    dcs_config: DCSConfig, tmp_path: Path
) -> None:
    config = dcs_config.model_copy(
        update={
            "bucket_size_bytes": 64 * 1024,
            "comm_timeout_seconds": 20.0,
            "group_init_timeout_seconds": 20.0,
            "max_retries": 1,
            "retry_delay_seconds": 0.2,
        }
    )
    with sync_stack(config, tmp_path, receivers=2) as stack:
        survivor, victim = stack.receivers
        model = Many()
        client = CheckpointEngineClient(
            coordinator_url=stack.url, role="actor", rank=0, model=model, model_name="many", config=stack.config
        )
        await client.start()
        try:
            await client.update_weights_for_rollout(rollout_only=True)
            v1 = digest_of(model)
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(-1.5)
            update = asyncio.create_task(client.update_weights_for_rollout(rollout_only=True))
            await asyncio.to_thread(wait_for_log, victim, "of v2 received", 5, 30.0)
            victim.kill()
            started = time.monotonic()
            with pytest.raises(WeightSyncError) as failure:
                await asyncio.wait_for(update, timeout=30)
            assert time.monotonic() - started < config.sync.comm_timeout_seconds
            assert failure.value.member == "rollout_1"
            assert "left paused with a partial update" in str(failure.value)
            kept = survivor.digest()  # no partial update: still v1, bit-exact
            assert kept.weight_version == 1 and kept.tensors == v1
            async with httpx.AsyncClient(base_url=survivor.url, timeout=10) as http:  # not left mid-session
                assert (await http.post("/begin_weight_update", json={})).status_code == 200
                assert (await http.post("/end_weight_update", json={})).status_code == 200

            await asyncio.to_thread(wait_registered, stack.url, "rollout", 1, 15.0, False)
            metrics = (await client.update_weights_for_rollout(rollout_only=True))["rollout"]
            assert metrics["group_rebuilt"] and metrics["engines"] == 1
            after = survivor.digest()
            assert after.weight_version == 2 and after.tensors == digest_of(model)
        finally:
            await client.stop()


async def test_engine_that_cannot_join_raises_group_init_error_naming_it(dcs_config: DCSConfig, tmp_path: Path) -> None:
    config = dcs_config.model_copy(
        update={
            "group_init_timeout_seconds": 3.0,
            "max_retries": 1,
            "retry_delay_seconds": 0.1,
        }
    )
    with sync_stack(config, tmp_path, receivers=1) as stack:
        ghost = {"role_name": "rollout", "rank": 1, "ip": "127.0.0.1", "port": 9}
        httpx.post(f"{stack.url}/register", json=ghost, timeout=10).raise_for_status()
        client = CheckpointEngineClient(
            coordinator_url=stack.url,
            role="actor",
            rank=0,
            model=torch.nn.Linear(2, 2),
            model_name="ghost",
            config=stack.config,
        )
        await client.start()
        try:
            started = time.monotonic()
            with pytest.raises(GroupInitError) as failure:
                await client.update_weights_for_rollout(rollout_only=True)
            assert failure.value.member == "rollout_1"
            assert "2 attempts" in str(failure.value)
            assert time.monotonic() - started < 4 * (config.sync.group_init_timeout_seconds + 2)
        finally:
            await client.stop()


async def test_a_session_left_open_by_a_dead_trainer_does_not_block_the_next_update(
    dcs_config: DCSConfig, tmp_path: Path
) -> None:
    config = dcs_config.model_copy(update={"comm_timeout_seconds": 20.0, "group_init_timeout_seconds": 20.0})
    with sync_stack(config, tmp_path, receivers=1) as stack:
        (receiver,) = stack.receivers
        async with httpx.AsyncClient(base_url=receiver.url, timeout=10) as http:  # a trainer died mid-update
            assert (await http.post("/pause_generation", json={"mode": "retract"})).status_code == 200
            assert (await http.post("/begin_weight_update", json={})).status_code == 200
        model = torch.nn.Linear(4, 4)
        client = CheckpointEngineClient(
            coordinator_url=stack.url, role="actor", rank=0, model=model, model_name="orphan", config=stack.config
        )
        await client.start()
        try:
            metrics = (await client.update_weights_for_rollout(rollout_only=True))["rollout"]
            assert metrics["weight_version"] == 1
            assert receiver.digest().tensors == digest_of(model)
            async with httpx.AsyncClient(base_url=receiver.url, timeout=10) as http:
                assert (await http.get("/model_info")).json()["weight_version"] == "1"
                again = await http.post("/end_weight_update", json={})  # the update closed its own session
                assert again.status_code == 400 and "no weight-update session is open" in again.json()["message"]
        finally:
            await client.stop()
