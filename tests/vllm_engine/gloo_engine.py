"""A gloo weight-transfer engine for vLLM, registered through vLLM's own `WeightTransferEngineFactory`.

vLLM's built-in `nccl` engine needs a GPU twice over: `PyNcclCommunicator` (libnccl, a CUDA device) for the
group, and `packed_nccl_broadcast_consumer`, which runs every receive on `torch.cuda.Stream`s. This engine is
vLLM's `NCCLWeightTransferEngine` with only those parts replaced, so everything else is vLLM's code: the
init/update info dataclasses and their validation (`parse_init_info`, `NCCLWeightTransferUpdateInfo`), the
worker's group rank (`nccl_common._worker_group_rank`: rank_offset + dp_rank * TP * PP + rank), the metadata
reuse of an empty update, the chunking rule of the packed consumer (a chunk ends after the tensor that takes it
over `packed_buffer_size_bytes`), `packed_tensor.unpack_tensor`, and the layerwise reload of start/finish.

The group is what DCS's trainer (and SGLang's `init_custom_process_group`) builds: a TCPStore client at
tcp://master_address:master_port, a `PrefixStore(group_name)`, a gloo process group; `group_name` is the one
init-info field vLLM's NCCL info lacks. `torch.accelerator.synchronize()` (vLLM's `update_weights`) raises on a
CPU-only torch, so it runs only where an accelerator exists.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from vllm.distributed.weight_transfer.base import WeightTransferEngine
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo, _worker_group_rank
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine, NCCLWeightTransferUpdateInfo
from vllm.distributed.weight_transfer.packed_tensor import unpack_tensor

BACKEND = "gloo"
GROUP_TIMEOUT_SECONDS = 60.0


@dataclass(kw_only=True)
class GlooWeightTransferInitInfo(NCCLWeightTransferInitInfo):
    """vLLM's NCCL init info plus the PrefixStore name of the group (DCS names each group it forms)."""

    group_name: str = "weight_transfer"
    timeout_seconds: float = GROUP_TIMEOUT_SECONDS


class GlooWeightTransferEngine(NCCLWeightTransferEngine):
    init_info_cls = GlooWeightTransferInitInfo  # type: ignore[assignment]
    update_info_cls = NCCLWeightTransferUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group: dist.ProcessGroup | None = None
        self.group_rank = -1

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:  # type: ignore[override]
        self.shutdown()
        self.packed = init_info.packed
        self.packed_buffer_size_bytes = init_info.packed_buffer_size_bytes
        self.packed_num_buffers = init_info.packed_num_buffers
        self._last_update_info.clear()
        rank = _worker_group_rank(init_info.rank_offset, self.parallel_config)
        timeout = timedelta(seconds=init_info.timeout_seconds)
        assert init_info.master_address is not None and init_info.master_port is not None
        store = dist.TCPStore(
            init_info.master_address, init_info.master_port, is_master=False, timeout=timeout, wait_for_workers=False
        )
        prefixed = c10d.PrefixStore(init_info.group_name, store)
        self.group, _ = c10d._new_process_group_helper(  # as SGLang's init_custom_process_group builds it
            init_info.world_size,
            rank,
            [],
            c10d.Backend(BACKEND),
            prefixed,
            group_name=c10d.GroupName(init_info.group_name),
            timeout=timeout,
        )
        self.group_rank = rank
        self.model_update_group = self.group  # type: ignore[assignment]  # vLLM's "initialised" check

    def update_weights(self, update_info: dict[str, Any]) -> None:
        typed = self.parse_update_info(update_info)
        self.receive_weights(typed)
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: NCCLWeightTransferUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer not initialized. Call init_transfer_engine() first.")
        if update_info.names:
            self._last_update_info[self.model] = update_info
        else:
            update_info = self._last_update_info.get(self.model, update_info)
        metas = [
            (name, list(shape), getattr(torch, dtype_name))
            for name, dtype_name, shape in zip(
                update_info.names, update_info.dtype_names, update_info.shapes, strict=True
            )
        ]
        if not self.packed:
            for name, shape, dtype in metas:
                weight = torch.empty(shape, dtype=dtype)
                self._broadcast(weight)
                self.model.load_weights([(name, weight)])
            return
        chunk: list[tuple[str, list[int], torch.dtype, int]] = []
        total = 0
        for name, shape, dtype in metas:  # vLLM's packed consumer: a chunk ends once it is over the buffer size
            size = math.prod(shape) * dtype.itemsize
            chunk.append((name, shape, dtype, size))
            total += size
            if total > self.packed_buffer_size_bytes:
                self._receive_chunk(chunk)
                chunk, total = [], 0
        if chunk:
            self._receive_chunk(chunk)

    def _receive_chunk(self, chunk: list[tuple[str, list[int], torch.dtype, int]]) -> None:
        packed = torch.empty(sum(c[3] for c in chunk), dtype=torch.uint8)
        self._broadcast(packed)
        names, shapes, dtypes, sizes = (list(x) for x in zip(*chunk, strict=True))
        self.model.load_weights(unpack_tensor(packed, names, shapes, dtypes, sizes))

    def _broadcast(self, tensor: torch.Tensor) -> None:
        assert self.group is not None
        view = tensor if tensor.dtype not in _GLOO_BYTES else tensor.view(torch.uint8)
        self.group.broadcast(view, 0).wait()

    def shutdown(self) -> None:
        group, self.group = self.group, None
        self.model_update_group = None
        if group is not None:
            try:
                dist.destroy_process_group(group)
            except (RuntimeError, ValueError, KeyError, AssertionError):
                pass


_GLOO_BYTES = {torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32, torch.uint64}
"""dtypes gloo cannot broadcast as themselves: received as their bytes (as DCS sends them)."""


def register() -> None:
    """Register `gloo` with vLLM's factory (once per process)."""
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, GlooWeightTransferEngine)


__all__ = ["GlooWeightTransferEngine", "GlooWeightTransferInitInfo", "WeightTransferEngine", "register"]
