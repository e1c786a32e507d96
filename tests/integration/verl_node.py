"""One verl worker of tests/integration/test_verl_backend.py: `python -m tests.integration.verl_node KIND`.

KIND: `trainer0` (verl's trainer rank 0: `is_master=True`), `trainer1` (another trainer rank: `is_master=False`) or
`rollout` (a rollout worker: no `is_master`, as verl's CheckpointEngineWorker builds it). The engine comes from
verl's own registry after verl's own `import_external_libs` imported the module named by verl's
`custom_backend_module`, as verl's workers do. The test drives the worker as verl's CheckpointEngineManager does
(prepare, build_topology in the test, init_process_group, send/receive, finalize) through one JSON command per
stdin line; each answer is one stdout line `@@ {json}`. DCS settings come from DCS_* in the environment.
"""

from __future__ import annotations

import asyncio
import json
import sys
import traceback
from collections.abc import Iterator
from typing import Any

import torch

from dcs_tasks.sync.receiving import tensor_sha256
from tests.verl_lib import on_path


def weights(seed: int) -> dict[str, torch.Tensor]:
    """What a trainer's `get_per_tensor_param` yields at step `seed`: mixed dtypes, one tensor over a bucket."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(32, 32, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(300, 40, generator=g),  # 48 KB > a 16 KiB bucket
        "model.layers.0.input_layernorm.weight": torch.randn(32, generator=g).to(torch.float16),
        "model.norm.steps": torch.tensor([seed], dtype=torch.int64),
    }


def digest(state: dict[str, torch.Tensor]) -> dict[str, str]:
    return {name: tensor_sha256(t) for name, t in sorted(state.items())}


def bad_entries(kind: str, seed: int) -> Iterator[tuple[Any, Any]]:
    yield from list(weights(seed).items())[:2]
    if kind == "not_a_tensor":
        yield "model.lm_head.weight", [[0.5, 0.25]]
    else:
        yield "model.layers." + "x" * 2000 + ".weight", torch.zeros(2)


async def main(kind: str) -> None:
    on_path()
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    import_external_libs("dcs_tasks.integrations.verl")  # verl's checkpoint_engine.custom_backend_module
    engine_kwargs: dict[str, Any] = {"model_name": "verl-test"}
    if kind != "rollout":
        engine_kwargs["is_master"] = kind == "trainer0"
    engine = CheckpointEngineRegistry.new("dcs", bucket_size=16 << 10, **engine_kwargs)
    loop = asyncio.get_running_loop()
    answer: Any = None
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        command = json.loads(line)
        op = command["op"]
        try:
            if op == "prepare":
                answer = {**engine.prepare(), "class": type(engine).__name__}
            elif op == "init":
                engine.init_process_group(**command["kwargs"])
                answer = "joined"
            elif op == "send":
                state = weights(command["seed"])
                metrics = await engine.send_weights((item for item in state.items()), global_steps=command["seed"])
                answer = {"metrics": metrics, "digest": digest(state)}
            elif op == "send_bad":
                await engine.send_weights(bad_entries(command["kind"], command["seed"]))
                answer = "sent"
            elif op == "receive":
                got = {name: t.clone() async for name, t in engine.receive_weights(global_steps=command.get("seed"))}
                answer = {"digest": digest(got), "version": engine.client.weight_version}
            elif op == "finalize":
                engine.finalize()
                answer = "finalized"
            elif op == "close":
                engine.close()
                print("@@ " + json.dumps({"ok": "closed"}), flush=True)
                return
            print("@@ " + json.dumps({"ok": answer}), flush=True)
        except Exception as exc:
            traceback.print_exc()
            print("@@ " + json.dumps({"error": type(exc).__name__, "message": str(exc)}), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
