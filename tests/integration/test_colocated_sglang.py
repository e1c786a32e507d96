"""Colocated updates into SGLang's own code on CPU (tests/sglang_engine): the trainer (this process) shares each
bucket through torch's shared-memory file and posts SGLang's `update_weights_from_tensor` with
`load_format="flattened_bucket"`; SGLang's TP schedulers unpickle the payload with SGLang's `SafeUnpickler`,
map the same file and load through SGLang's `FlattenedTensorBucket`. Slow (an engine starts: ~1 min)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from dcs_tasks.engine_http import EngineHTTP
from dcs_tasks.sync.colocated import ColocatedEngine, ColocatedSender
from tests.sglang_engine.harness import NEW, SGLangEngine, installed
from tests.sglang_engine.tiny_model import SHAPES

pytestmark = [pytest.mark.integration]

KEY = "colocated-sglang-key"


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g).to(dtype) for name, (shape, dtype) in SHAPES.items()}


@pytest.mark.skipif(not installed(NEW), reason=f"SGLang {NEW} not installed: run `make sglang-engines`")
def test_colocated_updates_into_sglang_tp2_through_its_own_serializer(tmp_path: Path) -> None:
    engine = SGLangEngine(NEW, tmp_path / "engine.log", tp=2, api_key=KEY)
    try:
        engine.start()

        async def run() -> list[int]:
            http = EngineHTTP(headers={"Authorization": f"Bearer {KEY}"})
            sender = ColocatedSender(torch.device("cpu"), bucket_size_bytes=600, http=http, release_seconds=60)
            buckets = []
            try:
                for version in (1, 2):
                    target = ColocatedEngine("rollout_0", engine.url, "sglang", tp_size=2)
                    report = await sender.update(weights(version), [target], version)
                    buckets.append(report.buckets)
                    state = weights(version)
                    for name in SHAPES:  # bit-exact, the TP-sharded weight gathered from both ranks
                        assert torch.equal(engine.weights(name), state[name]), name
                    info = engine.get("/model_info").json()
                    assert info["weight_version"] == str(version)
            finally:
                await http.aclose()
            return buckets

        buckets = asyncio.run(run())
        assert buckets[0] >= 2, "the update went in several flattened buckets"
        assert "Traceback" not in engine.log_since_ready()
    except BaseException:
        print(engine.log_tail())
        raise
    finally:
        engine.stop()
