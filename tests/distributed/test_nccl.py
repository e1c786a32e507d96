"""CUDA paths: fusion of device tensors, and an NCCL broadcast group between two GPUs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dcs_tasks.backends.fusion import TensorFusion
from tests.helpers.ports import free_port
from tests.helpers.procs import REPO

pytestmark = [pytest.mark.gpu, pytest.mark.distributed]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="NCCL needs one GPU per rank; fewer than 2 GPUs here",
)

NCCL_NODE = """
import json, sys, torch
from dcs_tasks.backends.base import GroupSpec
from dcs_tasks.backends.device_direct import DeviceDirectBackend
from dcs_tasks.backends.fusion import TensorFusion, unpack_views
from dcs_tasks.config import BackendType
rank, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
backend = DeviceDirectBackend(BackendType.NCCL, timeout_seconds=60, group_init_timeout_seconds=60, device_id=rank)
backend.create_group(GroupSpec("nccl", "127.0.0.1", port, 2, rank, BackendType.NCCL))
g = torch.Generator().manual_seed(5)
tensors = {"a": torch.randn(1000, generator=g).cuda(rank),
           "b": torch.randn(7, generator=g).to(torch.bfloat16).cuda(rank)}
fusion = TensorFusion()
buffer, layout = fusion.fuse(tensors)
if rank == 1:
    buffer.zero_()
backend.broadcast(buffer, 0, "nccl")
got = unpack_views(buffer, layout)
ok = all(torch.equal(got[n].view(torch.uint8), tensors[n].view(torch.uint8)) for n in tensors)
json.dump({"ok": ok}, open(out, "w"))
backend.close()
"""


@needs_cuda
def test_fusion_round_trip_on_cuda_is_bit_exact() -> None:
    tensors = {
        "w": torch.randn(64, 3, device="cuda"),
        "h": torch.randn(5, device="cuda").half(),
        "i": torch.arange(9, device="cuda"),
    }
    buffer, layout = TensorFusion().fuse(tensors)
    assert buffer.is_cuda
    back = TensorFusion().unfuse(buffer, layout)
    for name, tensor in tensors.items():
        assert torch.equal(back[name].view(torch.uint8), tensor.contiguous().view(torch.uint8))


@needs_two_gpus
def test_nccl_broadcast_of_a_fused_bucket(tmp_path: Path) -> None:
    port = free_port()
    outs = [tmp_path / f"r{r}.json" for r in range(2)]
    procs = [
        subprocess.Popen([sys.executable, "-c", NCCL_NODE, str(r), str(port), str(outs[r])], cwd=REPO) for r in range(2)
    ]
    assert [p.wait(timeout=180) for p in procs] == [0, 0]
    assert all(json.loads(o.read_text())["ok"] for o in outs)
