"""CheckpointEngineClient's checkpoint delegation (to dcs_tasks.checkpoint.Checkpointer) and create_client."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dcs_tasks.client.engine import create_client
from dcs_tasks.config import DCSConfig
from dcs_tasks.receiver.weights import tensor_sha256
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
