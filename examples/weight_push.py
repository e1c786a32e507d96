"""A weight push: a trainer sends its model's weights to every registered rollout engine (`dcs receiver`s here,
or SGLang/vLLM servers attached with `dcs engine attach`) over torch.distributed, then checks what they hold.

    dcs up --receivers 2                     # another shell: coordinator, worker, two receivers
    set -a; . .dcs-run/dcs.env; set +a       # DCS_COORDINATOR_URL, DCS_AUTH_TOKEN, ...
    python examples/weight_push.py

It prints the push's metrics (bytes, buckets, seconds, GB/s, weight version), then each receiver's weight
version and whether every tensor it holds is bit-exact (`/weights_digest`, a debug route of `dcs receiver`).
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import httpx
import torch

from dcs_tasks import DCSConfig
from dcs_tasks.client.engine import CheckpointEngineClient
from dcs_tasks.config import BackendType
from dcs_tasks.sync.receiving import tensor_sha256
from dcs_tasks.sync.wire import WeightsDigest


async def push(model: torch.nn.Module, config: DCSConfig) -> dict[str, Any]:
    client = CheckpointEngineClient(
        role="actor", rank=0, backend_type=BackendType.GLOO, model=model, model_name="tiny", config=config
    )
    await client.start()  # registers and heartbeats; forms the group with the engines on the first push
    try:
        return await client.update_weights_for_rollout()
    finally:
        await client.stop()


def check_receivers(model: torch.nn.Module, config: DCSConfig) -> bool:
    """Each rollout engine's version and whether it holds exactly the model's tensors."""
    headers = {"Authorization": f"Bearer {config.token()}"} if config.token() else {}
    url = config.base_url
    nodes = httpx.get(f"{url}/topology", params={"role_filter": "rollout"}, headers=headers, timeout=10).json()
    expected = {name: tensor_sha256(t) for name, t in model.state_dict().items()}
    all_exact = bool(nodes["nodes"].get("rollout"))
    for rank, node in sorted(nodes["nodes"].get("rollout", {}).items()):
        answer = httpx.get(f"http://{node['ip']}:{node['port']}/weights_digest", headers=headers, timeout=30)
        digest = WeightsDigest.model_validate_json(answer.content)
        exact = digest.tensors == expected
        all_exact &= exact
        print(f"receiver {rank}: weight version {digest.weight_version}, bit-exact: {exact}")
    return all_exact


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.parse_args(argv)
    config = DCSConfig()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 32))
    metrics = asyncio.run(push(model, config))
    print("push:", {k: v for k, v in metrics.get("rollout", {}).items() if not isinstance(v, dict | list)})
    return 0 if check_receivers(model, config) else 1


if __name__ == "__main__":
    raise SystemExit(main())
