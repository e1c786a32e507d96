"""Verified reads of checkpoint files kept in an object store: parallel ranged GETs, hashed in order.

The object-store side of `fileread` (same contract: `read_many` lands each file in fresh memory, `read_scatter`
lands each byte in its target or a scratch slot, and both check every file's size and checksum). Each file is
cut into `s3_part_bytes` ranges; `s3_read_concurrency` threads GET them (`readinto` the destination: no second
copy), at most that many plus two ahead of the calling thread, which hashes the ranges in file order as they
land. A short object or a checksum mismatch raises CorruptCheckpoint naming the object; nothing is still being
written when a function returns or raises.
"""

from __future__ import annotations

import functools
import mmap
import os
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from dcs_tasks.checkpoint.format.layout import FileEntry, new_hasher
from dcs_tasks.checkpoint.store.reads import zread
from dcs_tasks.checkpoint.store.reads.landing import Progress, Target, TargetIndex, anonymous
from dcs_tasks.errors import CorruptCheckpoint
from dcs_tasks.storage import ObjectPath
from dcs_tasks.storage.objpath import listed_sizes


def checked_size(path: ObjectPath, entry: FileEntry, listed: dict[str, int] | None = None) -> int:
    """The object's size, which must be the entry's stored size (CorruptCheckpoint otherwise). `listed`: sizes
    by key from a listing of the object's folder (`listed_sizes`), saving a HEAD per object."""
    size = listed.get(path.key) if listed is not None else path.size()
    if size is None:
        raise CorruptCheckpoint(f"checkpoint object {path} is missing", str(path))
    if size != entry.disk_size:
        raise CorruptCheckpoint(
            f"checkpoint object {path} has {size} bytes, manifest says {entry.disk_size}", str(path)
        )
    return size


@dataclass
class _Object:
    path: ObjectPath
    entry: FileEntry
    size: int
    hasher: Any = None
    targets: list[Target] = field(default_factory=list)
    index: TargetIndex = field(init=False)

    def __post_init__(self) -> None:
        self.index = TargetIndex(self.targets)

    def finish(self) -> None:
        if self.hasher is not None and self.hasher.hexdigest() != self.entry.checksum:
            raise CorruptCheckpoint(
                f"checkpoint object {self.path} fails its {self.entry.algorithm} checksum", str(self.path)
            )


@dataclass(frozen=True)
class _Range:
    obj: _Object
    begin: int
    end: int
    slot: int


def _ranges(objects: list[_Object], part: int, window: int) -> Iterator[_Range]:
    seq = 0
    for obj in objects:
        for begin in range(0, obj.size, part):
            yield _Range(obj, begin, min(begin + part, obj.size), seq % window)
            seq += 1


def _run(
    objects: list[_Object],
    verify: bool,
    land: Callable[[_Range], list[memoryview]],
    progress: Progress | None,
    part: int,
    window: int,
) -> None:
    if not objects:
        return
    for obj in objects:
        obj.hasher = new_hasher() if verify else None
    with objects[0].path.store.pool() as pool:
        inflight: deque[tuple[_Range, Future[list[memoryview]]]] = deque()
        try:
            for rng in _ranges(objects, part, window):
                if len(inflight) >= window:
                    _consume(*inflight.popleft(), progress)
                inflight.append((rng, pool.submit(land, rng)))
            while inflight:
                _consume(*inflight.popleft(), progress)
        finally:
            for _, future in inflight:
                future.cancel()
    for obj in objects:
        obj.finish()


def _consume(rng: _Range, future: Future[list[memoryview]], progress: Progress | None) -> None:
    for piece in future.result():
        if rng.obj.hasher is not None:
            rng.obj.hasher.update(piece)
    if progress is not None:
        progress(rng.obj.entry.name, rng.end, rng.obj.size)


def _geometry(objects: list[_Object]) -> tuple[int, int]:
    settings = objects[0].path.store.settings if objects else None
    part = settings.part_bytes if settings is not None else 32 * 1024 * 1024
    window = (settings.read_concurrency if settings is not None else 16) + 2
    return part, window


def read_many(
    files: list[tuple[ObjectPath, FileEntry]], verify: bool, progress: Progress | None = None
) -> list[mmap.mmap]:
    """Each object's bytes in its own fresh mapping (same order). Compressed objects (`<name>.zst`) are fetched
    whole, then decompressed into their mapping and checked like a plain file."""
    if any(entry.compression for _, entry in files):
        out = []
        for path, entry in files:
            if entry.compression:
                mapping = anonymous(entry.size)
                with memoryview(mapping) as whole:
                    _decode(path, entry, verify, functools.partial(_slice, whole), progress)
                out.append(mapping)
            else:
                out.extend(read_many([(path, entry)], verify, progress))
        return out
    listed = listed_sizes([path for path, _ in files])
    objects = [_Object(path, entry, checked_size(path, entry, listed)) for path, entry in files]
    # plain pages: reading from an object store, the client shares the CPU with the transfer itself, and huge
    # pages cost it 20-50% more CPU per restore on the development VM (landing.anonymous)
    mappings = [anonymous(o.size, huge_pages=False) for o in objects]
    views = {id(o): memoryview(m) for o, m in zip(objects, mappings, strict=True)}
    part, window = _geometry(objects)

    def land(rng: _Range) -> list[memoryview]:
        piece = views[id(rng.obj)][rng.begin : rng.end]
        rng.obj.path.store.read_into(rng.obj.path.key, rng.begin, [piece])
        return [piece]

    try:
        _run(objects, verify, land, progress, part, window)
    finally:
        for view in views.values():
            view.release()
    return mappings


def read_scatter(
    files: list[tuple[ObjectPath, FileEntry, list[Target]]], verify: bool, progress: Progress | None = None
) -> None:
    """Read each object once, each byte landing in its target, gaps in a scratch slot; no targets: verify only."""
    packed = [(path, entry, targets) for path, entry, targets in files if entry.compression]
    if packed:
        for path, entry, targets in packed:
            index = TargetIndex(targets)
            scratch = anonymous(min(entry.size, zread.CHUNK_BYTES) or 1)
            with memoryview(scratch) as gap:
                _decode(path, entry, verify, functools.partial(_pieces, index, gap), progress)
        files = [(path, entry, targets) for path, entry, targets in files if not entry.compression]
    listed = listed_sizes([path for path, _, _ in files])
    objects = [
        _Object(path, entry, checked_size(path, entry, listed), targets=targets) for path, entry, targets in files
    ]
    part, window = _geometry(objects)
    slot_bytes = min(part, max((o.size for o in objects), default=0))
    scratch = anonymous(max(1, window * slot_bytes))
    whole = memoryview(scratch)

    def land(rng: _Range) -> list[memoryview]:
        slot = whole[rng.slot * slot_bytes : (rng.slot + 1) * slot_bytes]
        pieces = rng.obj.index.pieces(slot, rng.begin, rng.end)
        rng.obj.path.store.read_into(rng.obj.path.key, rng.begin, pieces)
        return pieces

    try:
        _run(objects, verify, land, progress, part, window)
    finally:
        whole.release()


def _slice(whole: memoryview, begin: int, end: int) -> list[memoryview]:
    return [whole[begin:end]]


def _pieces(index: TargetIndex, gap: memoryview, begin: int, end: int) -> list[memoryview]:
    return index.pieces(gap, begin, end)


def _decode(
    path: ObjectPath,
    entry: FileEntry,
    verify: bool,
    land: Callable[[int, int], list[memoryview]],
    progress: Progress | None,
) -> None:
    """Fetch a compressed object whole (parallel ranged GETs into a memfd), then decompress it into `land`'s
    views, checking its frame, size, end and (`verify`) checksum (`zread.decode_fd`, as for a file)."""
    stored = checked_size(path, entry)
    fd = os.memfd_create("dcs-zst-object", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, stored)
        if stored:
            mapping = mmap.mmap(fd, stored, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            try:
                part = path.store.settings.part_bytes
                with memoryview(mapping) as whole, path.store.pool() as pool:
                    futures = [
                        pool.submit(path.store.read_into, path.key, b, [whole[b : min(b + part, stored)]])
                        for b in range(0, stored, part)
                    ]
                    try:
                        for f in futures:
                            f.result()
                    finally:
                        for f in futures:
                            f.cancel()
            finally:
                mapping.close()
        zread.decode_fd(fd, path, entry, verify, land, progress)
    finally:
        os.close(fd)
