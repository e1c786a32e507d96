"""DCS's weight-transfer engine for vLLM (backend "dcs"): one torch.distributed group per trainer, gloo or NCCL.

vLLM's own `nccl` engine rendezvouses through its `StatelessProcessGroup` and a `PyNcclCommunicator` (trainer at
rank 0, a warm-up all-reduce), which cannot share the torch.distributed group SGLang engines and DCS receivers
join. This engine is vLLM's `NCCLWeightTransferEngine` with only the group and the receive loop replaced: the
group is what DCS's trainer and SGLang's `init_custom_process_group` build (a TCPStore client at
tcp://master_address:master_port, a `PrefixStore(group_name)`, a process group of backend `transport`), so
SGLang engines, vLLM engines and DCS receivers are members of one group and each bucket is one broadcast from
rank 0. Everything else is vLLM's code: the init/update info dataclasses and their validation, the worker's
group rank (`nccl_common._worker_group_rank`: rank_offset + dp_rank * TP * PP + rank), the metadata reuse of
an empty update, the chunking rule of the packed consumer (a chunk ends after the tensor that takes it over
`packed_buffer_size_bytes`), `packed_tensor.unpack_tensor`, and the layerwise reload of start/finish.

Backend "dcs-ipc" (`DCSIpcWeightTransferEngine`) is the colocated transport: buckets by handle in DCS's JSON
frame (vllm_dcs/ipcframe.py), no group.

Init info: vLLM's NCCL fields plus `group_name`, `timeout_seconds` and `transport` ("gloo": tensors received on
the CPU, then loaded; "nccl": received on the worker's CUDA device). `torch.accelerator.synchronize()` (vLLM's
`update_weights`) runs only where an accelerator exists (it raises on a CPU-only torch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo
from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo, _worker_group_rank
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine, NCCLWeightTransferUpdateInfo
from vllm.distributed.weight_transfer.packed_tensor import unpack_tensor

from vllm_dcs import ipcframe

TRANSPORTS = ("gloo", "nccl")
GROUP_TIMEOUT_SECONDS = 60.0

_GLOO_BYTES = {torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32, torch.uint64}
"""dtypes gloo cannot broadcast as themselves: received as their bytes (as DCS sends them)."""


@dataclass(kw_only=True)
class DCSWeightTransferInitInfo(NCCLWeightTransferInitInfo):
    """vLLM's NCCL init info plus the group's PrefixStore name, its timeout and its torch.distributed backend."""

    group_name: str = "weight_transfer"
    timeout_seconds: float = GROUP_TIMEOUT_SECONDS
    transport: str = "gloo"

    def __post_init__(self) -> None:
        parent = getattr(super(), "__post_init__", None)
        if parent is not None:
            parent()
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport {self.transport!r} is not one of {', '.join(TRANSPORTS)}")
        if self.master_address is None or self.master_port is None:
            raise ValueError("the dcs backend rendezvouses at master_address:master_port; both are required")
        if not 0 < self.timeout_seconds <= 24 * 3600:
            raise ValueError(f"timeout_seconds={self.timeout_seconds} is not in (0, 86400]")


class DCSWeightTransferEngine(NCCLWeightTransferEngine):
    init_info_cls = DCSWeightTransferInitInfo  # type: ignore[assignment]
    update_info_cls = NCCLWeightTransferUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group: dist.ProcessGroup | None = None
        self.group_rank = -1
        self.transport = "gloo"

    def init_transfer_engine(self, init_info: DCSWeightTransferInitInfo) -> None:  # type: ignore[override]
        if init_info.transport == "nccl" and self.device.type != "cuda":
            raise ValueError(
                f"transport 'nccl' receives on the worker's CUDA device; this worker's model is on {self.device} "
                "(a trainer on a CPU host uses gloo)"
            )
        self.shutdown()
        self.transport = init_info.transport
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
            c10d.Backend(init_info.transport),
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
            raise RuntimeError("dcs weight transfer not initialized. Call init_transfer_engine() first.")
        if update_info.names:
            self._last_update_info[self.model] = update_info
        else:
            update_info = self._last_update_info.get(self.model, update_info)
        metas = [
            (name, list(shape), _dtype(dtype_name))
            for name, dtype_name, shape in zip(
                update_info.names, update_info.dtype_names, update_info.shapes, strict=True
            )
        ]
        if not self.packed:
            for name, shape, dtype in metas:
                weight = torch.empty(shape, dtype=dtype, device=self._receive_device)
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

    @property
    def _receive_device(self) -> torch.device:
        return self.device if self.transport == "nccl" else torch.device("cpu")

    def _receive_chunk(self, chunk: list[tuple[str, list[int], torch.dtype, int]]) -> None:
        packed = torch.empty(sum(c[3] for c in chunk), dtype=torch.uint8, device=self._receive_device)
        self._broadcast(packed)
        names, shapes, dtypes, sizes = (list(x) for x in zip(*chunk, strict=True))
        self.model.load_weights(unpack_tensor(packed, names, shapes, dtypes, sizes))

    def _broadcast(self, tensor: torch.Tensor) -> None:
        assert self.group is not None
        gloo_bytes = self.transport == "gloo" and tensor.dtype in _GLOO_BYTES
        self.group.broadcast(tensor.view(torch.uint8) if gloo_bytes else tensor, 0).wait()

    def shutdown(self) -> None:
        group, self.group = self.group, None
        self.model_update_group = None
        if group is not None:
            try:
                dist.destroy_process_group(group)
            except (RuntimeError, ValueError, KeyError, AssertionError):
                pass


@dataclass
class DCSIpcWeightTransferInitInfo(WeightTransferInitInfo):
    """Nothing to rendezvous: a colocated trainer shares each bucket by handle (`/init_weight_transfer_engine`
    is optional for backend "dcs-ipc")."""


@dataclass
class DCSIpcWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """`{"frame": {...}}`: DCS's colocated-update frame (vllm_dcs/ipcframe.py), checked here, when vLLM's
    `parse_update_info` builds this, so a bad frame is refused before any memory is opened."""

    frame: dict[str, Any]

    def __post_init__(self) -> None:
        self.parsed = ipcframe.from_json(self.frame)


class DCSIpcWeightTransferEngine(WeightTransferEngine[DCSIpcWeightTransferInitInfo, DCSIpcWeightTransferUpdateInfo]):
    """Backend "dcs-ipc": the dcs backend's colocated transport. Each `/update_weights` carries one DCS frame
    (JSON, fixed fields, never pickle) naming one bucket of the trainer's memory on this host: torch's
    shared-memory file on CPU, a CUDA IPC handle on GPU. The worker maps it read-only, copies each tensor out,
    loads the copies through the model's `load_weights` (vLLM's layerwise reload, as vLLM's `ipc` engine) and
    unmaps before it answers: the trainer reuses the bucket once the request is answered. A separate backend
    name, not an init-info transport: vLLM's `WeightTransferConfig` takes only `backend`, so the engine's
    `/server_info` shows whether its operator allowed updates by handle (the trainer checks it), and an engine
    started with backend "dcs" never opens memory an HTTP caller names."""

    init_info_cls = DCSIpcWeightTransferInitInfo
    update_info_cls = DCSIpcWeightTransferUpdateInfo

    def init_transfer_engine(self, init_info: DCSIpcWeightTransferInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: DCSIpcWeightTransferUpdateInfo) -> None:
        frame = update_info.parsed
        with ipcframe.open_bucket(frame, self.device) as bucket:
            weights = [
                (name, bucket[at : at + math.prod(shape) * dtype.itemsize].view(dtype).reshape(shape).clone())
                for name, dtype, shape, at in zip(frame.names, frame.dtypes, frame.shapes, frame.offsets, strict=True)
            ]
            if bucket.device.type == "cuda":
                torch.cuda.current_stream(bucket.device).synchronize()  # copied before the trainer reuses it
            del bucket
        if self.device.type != "cpu" and frame.kind == "shm":
            weights = [(name, t.to(self.device)) for name, t in weights]
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        with disable_mtp_completeness_check():
            self.model.load_weights(weights)

    def shutdown(self) -> None:
        pass


def _dtype(name: str) -> torch.dtype:
    """The torch dtype named `name` (an update's `dtype_names`); ValueError for anything else."""
    dtype = getattr(torch, name, None) if name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


__all__ = ["TRANSPORTS", "DCSIpcWeightTransferEngine", "DCSWeightTransferEngine", "DCSWeightTransferInitInfo"]
