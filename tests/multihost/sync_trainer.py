"""An actor that pushes weights to rollout receivers, as it runs on a simulated host:
`python -m tests.multihost.sync_trainer COORDINATOR_URL [IP]`.

A `CheckpointEngineClient` configured from the `DCS_*` environment with every address at its default (or
`ip=IP`, the original design's argument). Driven by JSON lines on stdin, one JSON answer per line on stdout:

  {"op": "state", "seed": S}                 {"digest": {name: sha256}} of the weights of seed S
  {"op": "update", "seed": S}                load seed S's weights and push them to the rollout engines;
                                             {"metrics": {...}, "digest": ..., "seconds": t}
  {"op": "update", "seed": S, "hold": K}     the same, but before bucket K is announced answer {"held": K}
                                             and wait for a line (e.g. {"op": "go"}) first: buckets < K are on
                                             every engine by then, so the test can cut a link between buckets
  {"op": "exit"}

An error is answered as {"ok": false, "error": "<DCSError subclass>: message", "seconds": t}.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

import torch

from dcs_tasks.backends.fusion import FusionLayout
from dcs_tasks.client.engine import CheckpointEngineClient
from dcs_tasks.config import DCSConfig
from dcs_tasks.sync.receiving import tensor_sha256

TENSORS, ROWS, COLS = 8, 256, 1024  # float32: 8 tensors of 1 MiB, and a bf16 one


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    state = {f"layer.{i}.weight": torch.randn(ROWS, COLS, generator=g) for i in range(TENSORS)}
    state["norm.weight"] = torch.randn(3, 5, generator=g).to(torch.bfloat16)
    return state


def digest(state: dict[str, torch.Tensor]) -> dict[str, str]:
    return {name: tensor_sha256(t) for name, t in state.items()}


def hold_before(client: CheckpointEngineClient, holding: dict[str, int | None]) -> None:
    """Wrap the rollout updater's per-bucket announcement: before bucket `holding["k"]`, answer and wait."""
    rollout = client._rollout
    assert rollout is not None
    original = rollout._announcer

    def announcer(*args: Any) -> Any:
        announce = original(*args)

        async def held(index: int, layout: FusionLayout, last: bool) -> None:
            if holding["k"] == index:
                print(json.dumps({"ok": True, "held": index}), flush=True)
                await asyncio.to_thread(sys.stdin.readline)
            await announce(index, layout, last)

        return held

    rollout._announcer = announcer  # type: ignore[method-assign]


async def handle(client: CheckpointEngineClient, holding: dict[str, int | None], cmd: dict[str, Any]) -> dict[str, Any]:
    state = weights(int(cmd["seed"]))
    if cmd["op"] == "state":
        return {"digest": digest(state)}
    client.model = state
    holding["k"] = cmd.get("hold")
    metrics = await client.update_weights_for_rollout(rollout_only=True)
    rollout = metrics["rollout"]
    keep = ("weight_version", "engines", "buckets", "group_name", "group_rebuilt", "bytes")
    return {"metrics": {k: rollout.get(k) for k in keep}, "digest": digest(state), "ip": client.role_info.ip}


async def main() -> None:
    url = sys.argv[1]
    ip = sys.argv[2] if len(sys.argv) > 2 else None
    client = CheckpointEngineClient(coordinator_url=url, model_name="mh", config=DCSConfig(), ip=ip)
    await client.start()
    holding: dict[str, int | None] = {"k": None}
    hold_before(client, holding)
    print(json.dumps({"ok": True, "ready": True, "ip": client.role_info.ip}), flush=True)
    try:
        while line := await asyncio.to_thread(sys.stdin.readline):
            cmd = json.loads(line)
            if cmd["op"] == "exit":
                break
            started = time.monotonic()
            try:
                answer = {"ok": True, **await handle(client, holding, cmd)}
            except Exception as exc:
                answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            answer["seconds"] = time.monotonic() - started
            print(json.dumps(answer), flush=True)
    finally:
        await client.stop()


if __name__ == "__main__":
    asyncio.run(main())
