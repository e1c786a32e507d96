"""One rank of the dtype sync test: `python -m tests.distributed.sync_dtypes_node RANK GROUP_PORT STORE_PORT OUT`.

Rank 0 sends `payload()` with the real `BucketSender` twice over gloo: update 1 flattened (fused buckets, and
tensors alone in a bucket sent from their own memory), update 2 one broadcast per tensor (SGLang's default wire
format). It announces each bucket's names/dtypes/shapes through a TCPStore, as the coordinator's weight meta
would. Rank 1 receives each update with the real `WeightReceiver` and commits it. Then rank 0 sends the payload
point-to-point twice (`DeviceDirectBackend.send`): whole (fused: its total reaches the fusion threshold) and two
tensors of it (one message per tensor). Rank 1 writes the sha256 of every tensor it got to OUT as JSON.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from dcs_tasks.backends.base import GroupSpec, RecvRequest, SendRequest
from dcs_tasks.backends.device_direct import DeviceDirectBackend
from dcs_tasks.backends.fusion import FusionLayout
from dcs_tasks.sync.receiving import WeightReceiver, tensor_sha256
from dcs_tasks.sync.sender import BucketSender
from dcs_tasks.tensors import TensorSpec

TIMEOUT = 60.0
PAIR = ("fp8_e4m3", "u64")  # the point-to-point dict sent one message per tensor


def _bits(n: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Random bytes viewed as `dtype`: every bit pattern (NaN payloads, values past int64's range) can appear."""
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype)


def payload() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "fp8_e4m3": _bits(301, torch.float8_e4m3fn, g).view(7, 43),
        "fp8_e5m2": _bits(64, torch.float8_e5m2, g),
        "u16": _bits(33, torch.uint16, g),
        "u32": _bits(9000, torch.uint32, g),  # 36 KB: alone in a bucket, sent from its own memory
        "u64": _bits(17, torch.uint64, g),
        "c64": _bits(10, torch.complex64, g),
        "c128": _bits(3, torch.complex128, g).view(3, 1),
        "mask": torch.rand(13, generator=g) > 0.5,
        "bf16": _bits(5, torch.bfloat16, g),
        "scalar_u16": _bits(1, torch.uint16, g).view(()),
        "empty_fp8": torch.empty(0, 3, dtype=torch.float8_e5m2),
    }


def digests(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {n: tensor_sha256(t) for n, t in tensors.items()}


def fusion_threshold() -> int:
    """The whole payload reaches it (fused); the `PAIR` does not (one message per tensor)."""
    return sum(TensorSpec.of(n, t).nbytes for n, t in payload().items())


def send(backend: DeviceDirectBackend, store: dist.TCPStore) -> None:
    state = payload()
    sender = BucketSender(backend, torch.device("cpu"), bucket_size_bytes=16 * 1024, alone_bytes=8 * 1024)
    for version, flattened in ((1, True), (2, False)):

        async def announce(k: int, layout: FusionLayout, last: bool, version: int = version) -> None:
            meta = {
                "names": layout.names,
                "dtypes": [s.dtype for s in layout.specs],
                "shapes": [list(s.shape) for s in layout.specs],
                "last": last,
            }
            store.set(f"v{version}/{k}", json.dumps(meta))

        push = sender.send_fused if flattened else sender.send_per_tensor
        asyncio.run(push(state, "g", announce))
    backend.send(SendRequest(state, dst_rank=1, group_name="g"))
    backend.send(SendRequest({n: state[n] for n in PAIR}, dst_rank=1, group_name="g"))


def receive(backend: DeviceDirectBackend, store: dist.TCPStore) -> dict[str, object]:
    receiver = WeightReceiver(backend)
    receiver.init_group(GroupSpec("g", "127.0.0.1", int(sys.argv[2]), 2, 1))
    seen: dict[str, object] = {}
    for version, flattened in ((1, True), (2, False)):
        k, last = 0, False
        while not last:
            meta = json.loads(store.get(f"v{version}/{k}"))
            receiver.receive_bucket(meta["names"], meta["dtypes"], meta["shapes"], "g", version, flattened)
            k, last = k + 1, meta["last"]
        receiver.commit(version)
        committed, sums = receiver.digest()
        seen[f"v{version}"] = {"version": committed, "buckets": k, "sums": sums}
    state = payload()
    for key, names in (("p2p_fused", list(state)), ("p2p_each", list(PAIR))):
        specs = [TensorSpec.of(n, state[n]) for n in names]
        got = backend.recv(RecvRequest(0, tuple(names), "g", {"specs": specs}))
        seen[key] = {"dtypes": {n: str(t.dtype) for n, t in got.items()}, "sums": digests(got)}
    return seen


def main() -> None:
    rank, group_port, store_port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    store = dist.TCPStore("127.0.0.1", store_port, 2, is_master=rank == 0, timeout=timedelta(seconds=TIMEOUT))
    backend = DeviceDirectBackend(
        timeout_seconds=TIMEOUT, group_init_timeout_seconds=TIMEOUT, fusion_threshold_bytes=fusion_threshold()
    )
    if rank == 0:
        backend.create_group(GroupSpec("g", "127.0.0.1", group_port, 2, 0))
        send(backend, store)
        store.get("done")  # keep the group (and the store) up until rank 1 has everything
    else:
        out.write_text(json.dumps(receive(backend, store)))
        store.set("done", "1")
    backend.close()
    os._exit(0)


if __name__ == "__main__":
    main()
