"""One rank of the DeviceDirectBackend test: `python -m tests.distributed.backend_node RANK PORT_A PORT_B OUT`.

Ranks 0-2 form group "a" (port A); ranks 0-1 also form group "b" (port B). Rank 0 broadcasts a fused
mixed-dtype bucket in each group and sends a tensor dict point-to-point to rank 1 over "b"; then rank 2
exits and rank 0 broadcasts again in "a", which must fail with WeightSyncError within the timeout.
Each rank writes what it saw to OUT as JSON.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from dcs_tasks.backends.base import GroupSpec, RecvRequest, SendRequest
from dcs_tasks.backends.device_direct import DeviceDirectBackend
from dcs_tasks.backends.fusion import FusionLayout, TensorFusion, TensorSpec, unpack_views
from dcs_tasks.config import RoleInfo
from dcs_tasks.errors import WeightSyncError
from dcs_tasks.sync.receiving import tensor_sha256


def payload(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "f32": torch.randn(33, 7, generator=g),
        "bf16": torch.randn(129, generator=g).to(torch.bfloat16),
        "i64": torch.randint(-(2**60), 2**60, (5,), generator=g),
        "mask": torch.rand(11, generator=g) > 0.5,
    }


def digests(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {n: tensor_sha256(t) for n, t in tensors.items()}


def broadcast_bucket(backend: DeviceDirectBackend, group: str, rank: int, seed: int) -> dict[str, str]:
    fusion = TensorFusion()
    layout = fusion.layout_of(payload(seed))
    buffer = fusion.fuse(payload(seed))[0] if rank == 0 else torch.empty(layout.total_bytes, dtype=torch.uint8)
    backend.broadcast_async(buffer, 0, group).wait()
    return digests(unpack_views(buffer, layout))


def main() -> None:
    rank, port_a, port_b, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    backend = DeviceDirectBackend(timeout_seconds=5.0, group_init_timeout_seconds=30.0)
    seen: dict[str, object] = {}
    backend.create_group(GroupSpec("a", "127.0.0.1", port_a, 3, rank))
    for peer in range(3):
        backend.register_peer("a", peer, RoleInfo(role_name="node", rank=peer))
    if rank < 2:
        backend.create_group(GroupSpec("b", "127.0.0.1", port_b, 2, rank))
    seen["a"] = broadcast_bucket(backend, "a", rank, seed=1)
    if rank < 2:
        seen["b"] = broadcast_bucket(backend, "b", rank, seed=2)
        specs = [TensorSpec.of(n, t) for n, t in payload(3).items()]
        if rank == 0:
            backend.send(SendRequest(payload(3), dst_rank=1, group_name="b"))
        else:
            got = backend.recv(RecvRequest(0, tuple(s.name for s in specs), "b", {"specs": specs}))
            seen["p2p"] = digests(got)
            assert FusionLayout.build(specs).names == list(got)
    if rank == 2:
        out.write_text(json.dumps(seen))
        os._exit(0)  # dies without leaving the group
    if rank == 0:
        time.sleep(1.0)
        started = time.monotonic()
        try:
            backend.broadcast(torch.zeros(8 * 1024 * 1024, dtype=torch.uint8), 0, "a")
            seen["dead_peer"] = {"error": None}
        except WeightSyncError as exc:
            seen["dead_peer"] = {"error": str(exc), "seconds": time.monotonic() - started}
    out.write_text(json.dumps(seen))
    os._exit(0)  # rank 1 is still a member of "a"; do not wait in teardown


if __name__ == "__main__":
    main()
