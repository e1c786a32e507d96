"""The device runtime the checkpoint pipelines use, behind one seam (`DeviceCopier`): side streams, events,
page-locked allocation, in-place registration and non-blocking copies. `CudaCopier` is torch.cuda's; a test passes a
runtime that runs the same pipelines on CPU tensors (tests/helpers/fakedevice.py). Used by `save/cuda.py` (staging
device tensors) and `restore/device.py` (restoring into them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from dcs_tasks.checkpoint.save.pinning import CudaHostPinner, HostPinner

_HOST_REGISTER_READ_ONLY = 8  # cudaHostRegisterReadOnly: register a read-only (copy-on-write) mapping in place


class Event(Protocol):
    def synchronize(self) -> None: ...


class DeviceCopier(Protocol):
    """What the pipeline asks of a device runtime."""

    @property
    def pinner(self) -> HostPinner:
        """Registers host memory in place (a memory-tier mapping: read-only)."""
        ...

    def on_device(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is a device tensor this copier fills (the restore takes this path)."""
        ...

    def pinned(self, nbytes: int) -> torch.Tensor:
        """`nbytes` of page-locked host memory, uint8."""
        ...

    def stream(self, device: torch.device) -> Any:
        """The side stream of `device`, ordered after the work already queued on its current stream."""
        ...

    def empty(self, like: torch.Tensor) -> torch.Tensor:
        """A new contiguous device tensor of `like`'s shape, dtype and device (where a strided target's bytes land)."""
        ...

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        """Queue `dst.copy_(src)` on `stream` without waiting (dst a device tensor, src page-locked host bytes)."""
        ...

    def record(self, stream: Any) -> Event:
        """An event that completes once everything queued on `stream` so far has run."""
        ...

    def synchronize(self, stream: Any) -> None:
        """Wait for everything queued on `stream`."""
        ...


class ReadOnlyCudaPinner:
    """`HostPinner` registering with `cudaHostRegisterReadOnly`: a private mapping of a sealed tmpfs file is
    page-locked without breaking copy-on-write (the file's own pages are pinned, none copied)."""

    def register(self, ptr: int, size: int) -> str | None:
        return CudaHostPinner._reason(torch.cuda.cudart().cudaHostRegister(ptr, size, _HOST_REGISTER_READ_ONLY))

    def unregister(self, ptr: int) -> str | None:
        return CudaHostPinner._reason(torch.cuda.cudart().cudaHostUnregister(ptr))


def _new_stream(device: torch.device) -> Any:
    return torch.cuda.Stream(device=device)


class CudaCopier:
    """`DeviceCopier` over torch.cuda: one side stream per device (`new_stream`), made once and kept."""

    def __init__(self, new_stream: Callable[[torch.device], Any] = _new_stream) -> None:
        self.pinner: HostPinner = ReadOnlyCudaPinner()
        self._new_stream = new_stream
        self._streams: dict[int, Any] = {}

    def on_device(self, tensor: torch.Tensor) -> bool:
        return tensor.is_cuda

    def pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def side_stream(self, device: torch.device) -> Any:
        """This copier's side stream on `device` (made the first time, then reused)."""
        index = device.index if device.index is not None else 0
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = self._new_stream(torch.device(device.type, index))
        return stream

    def stream(self, device: torch.device) -> Any:
        if device.index is None:
            device = torch.device(device.type, torch.cuda.current_device())
        stream = self.side_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        return stream

    def empty(self, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(like.shape, dtype=like.dtype, device=like.device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        with torch.cuda.stream(stream), torch.no_grad():
            dst.copy_(src, non_blocking=True)
        for t in (dst, src):  # memory the caching allocator must not hand out again before this copy ran
            if t.is_cuda:
                t.record_stream(stream)

    def record(self, stream: Any) -> Event:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def synchronize(self, stream: Any) -> None:
        stream.synchronize()
