"""CUDA staging: pinned registration of the staging mapping and non-blocking copies on a side stream.

Contract (the wait point): `Checkpointer.save()` enqueues the device-to-host copies on a side stream that
first waits for the trainer's current stream, then blocks until those copies are complete before it
returns. So when `save()` returns the state is staged and the optimizer may change the weights; work the
trainer queued before `save()` is included in the snapshot. The copy runs at pinned-memory bandwidth
because the mapping is registered with `cudaHostRegister` once per mapping (kept across saves, undone when
the mapping goes away; a refused registration is logged and the copy uses pageable memory: `pinning`).

One `DeviceStager` per checkpointer: it makes one side stream per device, the first time that device saves,
and reuses it for every later save.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dcs_tasks.checkpoint.format.layout import Layout
from dcs_tasks.checkpoint.save.pinning import CudaHostPinner, HostPinner
from dcs_tasks.checkpoint.save.staging import StagingBuffer, copy_into


def has_cuda_tensors(tensors: dict[str, torch.Tensor]) -> bool:
    return any(t.is_cuda for t in tensors.values())


def _new_stream(device: torch.device) -> Any:
    return torch.cuda.Stream(device=device)


class DeviceStager:
    """Stages device tensors into staging buffers for one checkpointer: one side stream per device."""

    def __init__(
        self, pinner: HostPinner | None = None, new_stream: Callable[[torch.device], Any] = _new_stream
    ) -> None:
        self.pinner: HostPinner = pinner or CudaHostPinner()
        self._new_stream = new_stream
        self._streams: dict[int, Any] = {}

    def stream(self, device: torch.device) -> Any:
        """This checkpointer's side stream on `device` (made once, then reused)."""
        index = device.index if device.index is not None else 0
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = self._new_stream(device)
        return stream

    def copy_from_device(
        self, buf: StagingBuffer, layout: Layout, tensors: dict[str, torch.Tensor], pinned: bool
    ) -> None:
        """Stage device tensors: side-stream non-blocking copies, then wait for them (the module contract)."""
        if pinned:
            buf.pin(self.pinner)  # False: refused and logged; the copy still works, from pageable memory
        device = next(t.device for t in tensors.values() if t.is_cuda)
        stream = self.stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            copy_into(buf, layout, tensors, non_blocking=True)
        stream.synchronize()
