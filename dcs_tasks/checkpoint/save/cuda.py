"""CUDA staging: pinned registration of the staging mapping and non-blocking copies on a side stream.

Contract (the wait point): `Checkpointer.save()` enqueues the device-to-host copies on a side stream that
first waits for the trainer's current stream (`enqueue`), so work the trainer queued before `save()` is included
in the snapshot. Without `overlap`, `save()` then waits for those copies (`Copies.wait`) and returns with the state
staged: the optimizer may change the weights. With `save(..., overlap=True)` it returns once they are queued; the
copies run beside the next forward and backward passes, and the dispatcher thread waits for them before the step
is persisted; the caller must not change the saved tensors until they are done (`guard(optimizer)` makes each
`optimizer.step()` wait). A copy that fails fails that save only.

The copy runs at pinned-memory bandwidth because the mapping is registered with `cudaHostRegister` once per
mapping (kept across saves, undone when the mapping goes away; a refused registration is logged and the copy
uses pageable memory: `pinning`). `Checkpointer.reserve()` (or `size_hint_bytes`) registers the buffers ahead, so
the first save does not.

The runtime is reached through `save/devicecopy.py`'s `DeviceCopier` (streams, events, copies): `CudaCopier` on a GPU, a
test's CPU runtime otherwise. One `DeviceStager` per checkpointer; the copier keeps one side stream per device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from dcs_tasks.checkpoint.format.layout import Layout
from dcs_tasks.checkpoint.save.devicecopy import CudaCopier, DeviceCopier, Event
from dcs_tasks.checkpoint.save.pinning import CudaHostPinner, HostPinner
from dcs_tasks.checkpoint.save.staging import StagingBuffer


def has_cuda_tensors(tensors: dict[str, torch.Tensor]) -> bool:
    return any(t.is_cuda for t in tensors.values())


@dataclass
class Copies:
    """The device-to-host copies of one save, queued: `wait()` blocks until they ran (raises what they raised)."""

    events: list[Event] = field(default_factory=list)

    def wait(self) -> None:
        for event in self.events:
            event.synchronize()
        self.events.clear()


class DeviceStager:
    """Stages device tensors into staging buffers for one checkpointer."""

    def __init__(
        self,
        pinner: HostPinner | None = None,
        copier: DeviceCopier | None = None,
        new_stream: Callable[[torch.device], Any] | None = None,
    ) -> None:
        self.pinner: HostPinner = pinner or CudaHostPinner()
        self._cuda = CudaCopier(new_stream) if new_stream is not None else CudaCopier()
        self._copier = copier

    @property
    def copier(self) -> DeviceCopier:
        return self._copier if self._copier is not None else self._cuda

    def stream(self, device: torch.device) -> Any:
        """The CUDA side stream on `device` (made once, then reused by every save)."""
        return self._cuda.side_stream(device)

    @property
    def available(self) -> bool:
        """Whether a device runtime is there (CUDA, or an injected one)."""
        return self._copier is not None or torch.cuda.is_available()

    def handles(self, tensors: dict[str, torch.Tensor]) -> bool:
        """Whether `tensors` hold a device tensor this stager copies."""
        return self.available and any(self.copier.on_device(t) for t in tensors.values())

    @torch.no_grad()
    def enqueue(self, buf: StagingBuffer, layout: Layout, tensors: dict[str, torch.Tensor], pinned: bool) -> Copies:
        """Queue the copies of every device tensor into its slot of `buf` (headers already written) on its device's
        side stream, after the work already queued on the current stream; host tensors are copied at once."""
        if pinned:
            buf.pin(self.pinner)  # False: refused and logged; the copy still works, from pageable memory
        assert buf.view is not None
        view = buf.view
        streams: dict[torch.device, Any] = {}
        for f in layout.files:
            base = f.offset + f.data_start
            for slot in f.slots:
                if slot.end == slot.begin:
                    continue
                src = tensors[slot.spec.name]
                dst = view[base + slot.begin : base + slot.end].view(src.dtype).view(src.shape)
                if not self.copier.on_device(src):
                    dst.copy_(src)
                    continue
                stream = streams.get(src.device)
                if stream is None:
                    stream = streams[src.device] = self.copier.stream(src.device)
                self.copier.copy(dst, src, stream)
        return Copies([self.copier.record(stream) for stream in streams.values()])

    def copy_from_device(
        self, buf: StagingBuffer, layout: Layout, tensors: dict[str, torch.Tensor], pinned: bool
    ) -> None:
        """Stage device tensors: side-stream non-blocking copies, then wait for them (the module contract)."""
        self.enqueue(buf, layout, tensors, pinned).wait()

    def pin(self, buf: StagingBuffer) -> bool:
        """Register `buf`'s mapping now (`Checkpointer.reserve`), so no save pays for it."""
        return buf.pin(self.pinner)
