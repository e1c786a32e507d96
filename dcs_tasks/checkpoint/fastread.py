"""Whole-file reads for `restore()`: one sequential pass per file into one anonymous mapping.

The file lands in a fresh anonymous mapping and is hashed chunk by chunk as it arrives (measured on the
CI machines: O_DIRECT or MAP_POPULATE made this slower, not faster; the cost above the read limit is the
kernel handing out fresh pages, which any restore into new memory pays). Each tensor is then
`torch.frombuffer` over its own slice: its storage starts at the tensor's first byte (storage offset 0,
storage size = tensor size, as torch APIs like `set_rng_state` expect) while the bytes stay where the read
put them. The mapping lives as long as any of its tensors.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any

import torch

from dcs_tasks.checkpoint.format import CODE_DTYPES, FileEntry, TensorEntry, new_hasher
from dcs_tasks.checkpoint.fsio import CHUNK_BYTES, DIRECT_ALIGN
from dcs_tasks.errors import CorruptCheckpoint


def checked_size(path: Path, entry: FileEntry) -> int:
    try:
        size = path.stat().st_size
    except FileNotFoundError as exc:
        raise CorruptCheckpoint(f"checkpoint file {path} is missing", str(path)) from exc
    if size != entry.size:
        raise CorruptCheckpoint(f"checkpoint file {path} has {size} bytes, manifest says {entry.size}", str(path))
    return size


def read_whole(path: Path, entry: FileEntry, verify: bool) -> mmap.mmap:
    """The file's bytes in a fresh mapping (length rounded up to a page); CorruptCheckpoint names the file."""
    size = checked_size(path, entry)
    padded = max(DIRECT_ALIGN, -(-size // DIRECT_ALIGN) * DIRECT_ALIGN)
    mapping = mmap.mmap(-1, padded, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    hasher = new_hasher() if verify else None
    fd = os.open(path, os.O_RDONLY)
    try:
        with memoryview(mapping) as view:
            _fill(fd, view, size, path, hasher)
    finally:
        os.close(fd)
    if hasher is not None and hasher.hexdigest() != entry.checksum:
        raise CorruptCheckpoint(f"checkpoint file {path} fails its {entry.algorithm} checksum", str(path))
    return mapping


def _fill(fd: int, view: memoryview, size: int, path: Path, hasher: Any) -> None:
    pos = 0
    while pos < size:
        with view[pos : min(pos + CHUNK_BYTES, size)] as chunk:
            n = os.preadv(fd, [chunk], pos)
        if not n:
            raise CorruptCheckpoint(f"checkpoint file {path} ended early at byte {pos}", str(path))
        n = min(n, size - pos)
        if hasher is not None:
            with view[pos : pos + n] as got:
                hasher.update(got)
        pos += n


def tensors_over(mapping: mmap.mmap, entries: dict[str, TensorEntry]) -> dict[str, torch.Tensor]:
    """One tensor per entry, each with its own storage over its slice of `mapping` (no copy)."""
    view = memoryview(mapping)
    out: dict[str, torch.Tensor] = {}
    for name, entry in entries.items():
        begin, end = entry.offsets
        dtype = CODE_DTYPES[entry.dtype]
        if end == begin:
            out[name] = torch.empty(entry.shape, dtype=dtype)
        else:
            out[name] = torch.frombuffer(view[begin:end], dtype=dtype).view(entry.shape)
    return out
