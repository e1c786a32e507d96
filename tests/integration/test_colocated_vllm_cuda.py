"""Colocated updates into vLLM's plugin by CUDA IPC between two processes on one GPU: the trainer (this process)
packs a bucket on cuda:0 (DCS's `BucketPool`) and sends DCS's frame; a second process runs the plugin's
`DCSIpcWeightTransferEngine.update_weights` (vLLM's `parse_update_info`, the plugin's frame reader, torch's IPC
rebuild from the checked fields), which copies every tensor out on the GPU and loads the copies; the bytes loaded
equal the trainer's. Needs CUDA and the harness's vLLM (`make vllm-engines`); skipped without either (never run
on the CPU-only CI)."""

from __future__ import annotations

import json
import multiprocessing
import sys
from typing import Any

import pytest
import torch

from dcs_tasks.backends.fusion import pack_into, sglang_layout
from dcs_tasks.sync.colocated import BucketPool
from dcs_tasks.sync.ipcframe import frame_for
from dcs_tasks.tensors import TensorSpec
from tests.vllm_engine.harness import NEWEST, VLLM_ROOT, installed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.integration,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch.cuda.is_available() is False)"),
    pytest.mark.skipif(not installed(), reason="vLLM not installed under .vllm/ (make vllm-engines)"),
]


def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "model.layers.0.w": torch.randn(256, 128, generator=g).cuda(),
        "model.layers.0.b": torch.randn(128, generator=g).to(torch.bfloat16).cuda(),
        "model.ids": torch.arange(77, dtype=torch.int16).cuda(),
    }


def _engine_child(paths: list[str], frame: str, out: Any) -> None:
    sys.path[:0] = paths
    from vllm_dcs.engine import DCSIpcWeightTransferEngine

    class Sink(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.loaded: dict[str, torch.Tensor] = {}

        def load_weights(self, weights: Any) -> set[str]:
            self.loaded.update(weights)
            return set(self.loaded)

    engine = DCSIpcWeightTransferEngine.__new__(DCSIpcWeightTransferEngine)  # vLLM's worker builds it with a model
    engine.device = torch.device("cuda:0")
    engine.model = Sink()
    engine.update_weights({"frame": json.loads(frame)})
    assert all(t.device.type == "cuda" for t in engine.model.loaded.values())
    out.put({name: bytes(t.view(torch.uint8).flatten().cpu().numpy()) for name, t in engine.model.loaded.items()})


def test_the_plugin_loads_a_bucket_shared_by_cuda_ipc_bit_exact() -> None:
    s = state()
    layout = sglang_layout([TensorSpec.of(k, v) for k, v in s.items()])
    pool = BucketPool(torch.device("cuda:0"), layout.total_bytes)
    pack_into(pool.slots[0].tensor, layout, s)
    torch.cuda.synchronize()
    frame = frame_for("cuda", 0, 0, layout, 1, True, cuda=pool.slots[0].cuda)
    paths = [str(VLLM_ROOT / NEWEST), str(VLLM_ROOT / "deps"), str(VLLM_ROOT / "plugins")]
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=_engine_child, args=(paths, frame.encode().decode(), out))
    child.start()
    try:
        loaded = out.get(timeout=300)
    finally:
        child.join(60)
    assert child.exitcode == 0
    assert loaded == {name: bytes(t.view(torch.uint8).flatten().cpu().numpy()) for name, t in s.items()}
