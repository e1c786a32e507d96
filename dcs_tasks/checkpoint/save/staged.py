"""A state copied into a staging buffer ahead of its step: `Checkpointer.stage()` makes one, `commit_staged()` sends it.

The two halves of `Checkpointer.save()` apart, for callers that must copy the state at one moment and learn the step's
metadata later (torch DCP's `async_save`: the copy at the call, DCP's planning on its own thread afterwards). The
buffer stays leased from `stage()` until the commit's persist tasks are done, or until `release()` gives it back
unsaved; either way it is consumed once.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from dcs_tasks.checkpoint.format.layout import Layout
from dcs_tasks.checkpoint.save.staging import BufferLease
from dcs_tasks.checkpoint.state.structure import FlatState


@dataclass
class StagedState:
    """A state's bytes in a leased staging buffer, not yet a step. `views`: name -> the staged copy of each tensor
    of `flat` (CPU tensors over the staging mapping: read them, never write them); `stall_seconds`: what the copy
    cost the caller. Commit it with `Checkpointer.commit_staged(staged, step)`, or `release()` it."""

    lease: BufferLease
    layout: Layout
    flat: FlatState
    views: dict[str, torch.Tensor]
    stall_seconds: float
    owner: object = field(repr=False, default=None)  # the pool it was leased from: only its checkpointer commits it
    _taken: bool = field(default=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def take(self) -> bool:
        """Claim the staged copy for a commit or a release: True the first time only."""
        with self._lock:
            taken, self._taken = self._taken, True
        return not taken

    @property
    def consumed(self) -> bool:
        """True once committed or released."""
        with self._lock:
            return self._taken

    def release(self) -> bool:
        """Give the buffer back without saving (True), or do nothing when already committed or released (False)."""
        if not self.take():
            return False
        self.lease.release()
        return True


def views_of(buffer_view: torch.Tensor, layout: Layout, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """name -> the tensor over `buffer_view` (a staging mapping) where `layout` put each of `tensors` (the same
    dtype and shape; an empty tensor is a fresh empty one)."""
    out: dict[str, torch.Tensor] = {}
    for f in layout.files:
        base = f.offset + f.data_start
        for slot in f.slots:
            src = tensors[slot.spec.name]
            if slot.end == slot.begin:
                out[slot.spec.name] = torch.empty(src.shape, dtype=src.dtype)
            else:
                out[slot.spec.name] = buffer_view[base + slot.begin : base + slot.end].view(src.dtype).view(src.shape)
    return out
