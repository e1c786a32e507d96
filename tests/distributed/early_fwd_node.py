"""One node of the actor_fwd-before-actor test, run as `python -m tests.distributed.early_fwd_node ROLE OUT`.

actor_fwd: register, print "init" (flushed), call `init_process_groups_for_actor_fwd_ref(1)` at once (no wait for
the actor: the point of the test), receive one update. actor: register as the pp stage 0 source, init, push one
update. Config comes from DCS_* env; OUT gets JSON with wall-clock times and a digest of the weights.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import torch

from dcs_tasks.client.engine import CheckpointEngineClient
from dcs_tasks.config import DCSConfig
from dcs_tasks.sync.receiving import tensor_sha256


def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {"w": torch.randn(33, 5, generator=g), "b": torch.randn(64, generator=g).to(torch.bfloat16)}


def digest(weights: dict[str, torch.Tensor]) -> dict[str, str]:
    return {name: tensor_sha256(t) for name, t in weights.items()}


async def run(role: str) -> dict[str, object]:
    config = DCSConfig()
    is_actor = role == "actor"
    client = CheckpointEngineClient(
        coordinator_url=config.base_url,
        role=role,
        rank=0,
        model=state() if is_actor else None,
        model_name="early",
        config=config,
        metadata={"pp_rank": 0, "pp_size": 1, "is_pp_src_rank": True} if is_actor else {},
    )
    await client.start()
    out: dict[str, object] = {"registered": time.time()}
    try:
        print("init", flush=True)
        out["init_called"] = time.time()
        out["joined"] = await client.init_process_groups_for_actor_fwd_ref(1, wait_timeout_s=90)
        out["init_returned"] = time.time()
        if is_actor:
            await client.update_weights_for_rollout(actor_fwd_only=True)
            out["digest"] = digest(state())
        else:
            out["version"] = await client.recv_weight()
            out["digest"] = digest(client.received_weights)
    finally:
        await client.stop()
    return out


if __name__ == "__main__":
    Path(sys.argv[2]).write_text(json.dumps(asyncio.run(run(sys.argv[1]))))
