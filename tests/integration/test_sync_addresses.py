"""Addresses a trainer advertises: the default follows the coordinator, a loopback master with an engine on
another host fails at once by name. (Across real network namespaces: tests/multihost/test_weight_sync.py.)"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from dcs_tasks.client.engine import CheckpointEngineClient
from dcs_tasks.config import DCSConfig, RoleInfo
from dcs_tasks.coordinator_api import CoordinatorAPI
from dcs_tasks.errors import LoopbackAddressError
from tests.distributed.sync_stack import sync_stack

pytestmark = [pytest.mark.integration]


async def test_a_loopback_trainer_with_an_engine_elsewhere_fails_before_any_probe_or_join(
    dcs_config: DCSConfig, tmp_path: Path
) -> None:
    config = dcs_config.model_copy(update={"group_init_timeout_seconds": 30.0, "max_retries": 3})
    with sync_stack(config, tmp_path) as stack:
        api = CoordinatorAPI(stack.url, config.token())
        engine = RoleInfo(role_name="rollout", rank=0, ip="203.0.113.5", port=30000)  # TEST-NET-3: unreachable
        await api.register(engine)
        model = {"w": torch.ones(4)}
        client = CheckpointEngineClient(coordinator_url=stack.url, model=model, config=config, ip="127.0.0.1")
        default = CheckpointEngineClient(coordinator_url=stack.url, model=model, config=config)
        assert default.role_info.ip == "127.0.0.1"  # the route to a coordinator on loopback
        await client.start()
        try:
            started = time.monotonic()
            with pytest.raises(LoopbackAddressError, match=r"127\.0\.0\.1 is loopback but rollout_0 is at 203") as err:
                await client.update_weights_for_rollout(rollout_only=True)
            assert time.monotonic() - started < 2  # no /server_info probe, no join, no retry
            assert err.value.member == "rollout_0"
        finally:
            await client.stop()
            await api.aclose()
