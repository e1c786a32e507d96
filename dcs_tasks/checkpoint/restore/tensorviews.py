"""Tensors over a verified read's memory: a file that `fileread.read_many` landed in a fresh mapping, sliced into
one tensor per entry, each owning its storage (offset 0), without a copy. The torch side of the readers (which
import no torch).
"""

from __future__ import annotations

import mmap
from typing import TYPE_CHECKING

from dcs_tasks.checkpoint.format.layout import TensorEntry
from dcs_tasks.tensors import code_dtype

if TYPE_CHECKING:  # torch is imported on first use: a worker imports the reader (for `latest`) and never torch
    import torch


def tensors_over(mapping: mmap.mmap, entries: dict[str, TensorEntry]) -> dict[str, torch.Tensor]:
    """One tensor per entry, each with its own storage over its slice of `mapping` (no copy)."""
    import torch

    view = memoryview(mapping)
    out: dict[str, torch.Tensor] = {}
    for name, entry in entries.items():
        begin, end = entry.offsets
        dtype = code_dtype(entry.dtype)
        if end == begin:
            out[name] = torch.empty(entry.shape, dtype=dtype)
        else:
            out[name] = torch.frombuffer(view[begin:end], dtype=dtype).view(entry.shape)
    return out
