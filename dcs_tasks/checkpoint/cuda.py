"""CUDA staging: pinned registration of the staging mapping and non-blocking copies on a side stream.

Contract (the wait point): `Checkpointer.save()` enqueues the device-to-host copies on a side stream that
first waits for the trainer's current stream, then blocks until those copies are complete before it
returns. So when `save()` returns the state is staged and the optimizer may change the weights; work the
trainer queued before `save()` is included in the snapshot. The copy runs at pinned-memory bandwidth
because the mapping is registered with `cudaHostRegister` once per buffer (kept across saves).
"""

from __future__ import annotations

import torch

from dcs_tasks.checkpoint.format import Layout
from dcs_tasks.checkpoint.staging import StagingBuffer, copy_into

_registered: dict[int, int] = {}  # data_ptr -> size of mappings registered as pinned memory
_streams: dict[int, torch.cuda.Stream] = {}


def has_cuda_tensors(tensors: dict[str, torch.Tensor]) -> bool:
    return any(t.is_cuda for t in tensors.values())


def pin(buf: StagingBuffer) -> None:
    """Register the buffer's mapping as page-locked memory (idempotent per mapping)."""
    assert buf.view is not None
    ptr, size = buf.view.data_ptr(), buf.view.numel()
    if _registered.get(ptr) == size:
        return
    err = torch.cuda.cudart().cudaHostRegister(ptr, size, 0)
    if int(err) == 0:
        _registered[ptr] = size


def copy_from_device(buf: StagingBuffer, layout: Layout, tensors: dict[str, torch.Tensor], pinned: bool) -> None:
    """Stage device tensors: side-stream non-blocking copies, then wait for them (see the module contract)."""
    if pinned:
        pin(buf)
    device = next(t.device for t in tensors.values() if t.is_cuda)
    stream = _streams.setdefault(device.index or 0, torch.cuda.Stream(device=device))
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        copy_into(buf, layout, tensors, non_blocking=True)
    stream.synchronize()
