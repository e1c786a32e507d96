"""Actor -> 2 real `dcs receiver` servers through the real coordinator, worker and gloo: bit-exact, versioned."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dcs_tasks.client.engine import CheckpointEngineClient
from dcs_tasks.config import DCSConfig
from dcs_tasks.receiver.weights import tensor_sha256
from tests.distributed.sync_stack import sync_stack

pytestmark = [pytest.mark.integration, pytest.mark.distributed, pytest.mark.slow]


class Tiny(torch.nn.Module):
    """Mixed dtypes, many small tensors and a bigger one; big enough for several 4 KiB buckets."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(6))
        self.head = torch.nn.Linear(8, 64)
        self.emb = torch.nn.Parameter(torch.randn(32, 16).to(torch.bfloat16))
        self.register_buffer("steps", torch.tensor([0], dtype=torch.int64))


def sync_config(dcs_config: DCSConfig) -> DCSConfig:
    return dcs_config.model_copy(
        update={
            "bucket_size_bytes": 4096,
            "comm_timeout_seconds": 20.0,
            "group_init_timeout_seconds": 20.0,
            "max_retries": 1,
            "retry_delay_seconds": 0.2,
        }
    )


def expected_digest(model: torch.nn.Module) -> dict[str, str]:
    return {name: tensor_sha256(t) for name, t in model.state_dict().items()}


def train_step(model: Tiny) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
        model.steps += 1


async def test_actor_pushes_bit_exact_weights_to_two_receivers(dcs_config: DCSConfig, tmp_path: Path) -> None:
    config = sync_config(dcs_config)
    with sync_stack(config, tmp_path, receivers=2) as stack:
        model = Tiny()
        client = CheckpointEngineClient(
            coordinator_url=stack.url, role="actor", rank=0, model=model, model_name="tiny", config=stack.config
        )
        await client.start()
        try:
            for update in range(1, 4):
                train_step(model)
                metrics = (await client.update_weights_for_rollout(rollout_only=True))["rollout"]
                assert metrics["weight_version"] == update
                assert metrics["group_rebuilt"] is (update == 1)
                assert metrics["buckets"] > 1 and metrics["engines"] == 2
                for receiver in stack.receivers:
                    digest = receiver.digest()
                    assert digest.weight_version == update
                    assert digest.tensors == expected_digest(model)
        finally:
            await client.stop()
