"""Verified reads of checkpoint files on a file system (restore's, and every reader's of files): chunked O_DIRECT
reads in a few threads, hashed in order.

Measured on the 2-core CI VM (1 GiB in 4 files, page cache dropped): the disk gives ~0.54 s with O_DIRECT
against ~0.7 s buffered (the buffered path adds a page-cache copy); fresh 4 KiB pages cost ~0.45 s/GiB to
fault in, transparent huge pages ~0.25 s/GiB; xxh3 costs ~0.15 s/GiB of one core. So every file is split
into `CHUNK_BYTES` chunks that `IO_THREADS` threads read with `preadv` (O_DIRECT where the file system
allows it, else buffered; the GIL is released), while the calling thread hashes the chunks in file order
as they land. Faulting and hashing overlap the transfers of other chunks. A file that is mostly in the page
cache already (sampled with mincore) is read buffered instead: copying it costs ~0.35 s/GiB here, half of
what O_DIRECT, which ignores the cache, would take.

Destinations: `read_many` lands each file in a fresh anonymous mapping (MADV_HUGEPAGE from 8 MiB on)
that restore's `tensorviews.tensors_over` then slices into tensors that own their storage (offset 0) without a copy.
`read_scatter` (`into=`, verify) reads each chunk with one buffered `preadv` straight into the caller's
tensors (their addresses are not aligned for O_DIRECT, and O_DIRECT into a bounce buffer plus a copy
measured slower), gaps into scratch; with no targets (verify) it reads O_DIRECT into scratch. A short read
or a checksum mismatch raises CorruptCheckpoint naming the file; nothing is still being written when a
read function returns or raises.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import stat
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dcs_tasks.checkpoint.format import iosizes
from dcs_tasks.checkpoint.format.iosizes import DIRECT_ALIGN as DIRECT_ALIGN
from dcs_tasks.checkpoint.format.iosizes import READ_CHUNK_BYTES, READ_THREADS
from dcs_tasks.checkpoint.format.layout import FileEntry, new_hasher
from dcs_tasks.checkpoint.store.reads import zread
from dcs_tasks.checkpoint.store.reads.landing import HUGE_FROM as HUGE_FROM
from dcs_tasks.checkpoint.store.reads.landing import HUGE_PAGE as HUGE_PAGE
from dcs_tasks.checkpoint.store.reads.landing import Progress as Progress
from dcs_tasks.checkpoint.store.reads.landing import Target as Target
from dcs_tasks.checkpoint.store.reads.landing import TargetIndex as TargetIndex
from dcs_tasks.checkpoint.store.reads.landing import anonymous as anonymous
from dcs_tasks.errors import CorruptCheckpoint

CHUNK_BYTES = READ_CHUNK_BYTES
IO_THREADS = READ_THREADS
WINDOW = IO_THREADS + 2  # chunks read ahead of the hashing thread (also the number of bounce buffers)
O_DIRECT: int = iosizes.O_DIRECT  # module attributes: tests patch them here
O_NOFOLLOW: int = iosizes.O_NOFOLLOW
CACHED_ENOUGH = 0.5  # files at least this much in the page cache are read buffered (a copy beats the disk)

IOV_MAX = 512  # iovec entries per preadv call (the kernel takes 1024)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
MAP_FAILED = ctypes.c_void_p(-1).value


def cached_fraction(fd: int, size: int, probes: int = 64) -> float:
    """Share of `probes` pages, spread over the file, that are in the page cache (mincore over a read-only
    mapping: no I/O, microseconds). 0.0 when it cannot tell."""
    if size == 0:
        return 0.0
    addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr in (None, MAP_FAILED):
        return 0.0
    try:
        pages = -(-size // mmap.PAGESIZE)
        picks = sorted({pages * i // probes for i in range(probes)})
        vec = ctypes.c_ubyte()
        hits = 0
        for page in picks:
            if _libc.mincore(addr + page * mmap.PAGESIZE, mmap.PAGESIZE, ctypes.byref(vec)) != 0:
                return 0.0
            hits += vec.value & 1
        return hits / len(picks)
    finally:
        _libc.munmap(addr, size)


def checked_size(path: Path, entry: FileEntry) -> int:
    """The file's size, which must be `entry.size`; a symlink or anything but a regular file is refused
    (lstat: never followed)."""
    try:
        info = path.lstat()
    except FileNotFoundError as exc:
        raise CorruptCheckpoint(f"checkpoint file {path} is missing", str(path)) from exc
    if not stat.S_ISREG(info.st_mode):
        raise CorruptCheckpoint(f"checkpoint file {path} is not a regular file", str(path))
    if info.st_size != entry.size:
        raise CorruptCheckpoint(
            f"checkpoint file {path} has {info.st_size} bytes, manifest says {entry.size}", str(path)
        )
    return info.st_size


@dataclass
class _File:
    """One open checkpoint file being read."""

    path: Path
    entry: FileEntry
    size: int
    fd: int = -1  # buffered
    direct_fd: int = -1  # O_DIRECT, when the file system takes it
    hasher: Any = None
    targets: list[Target] = field(default_factory=list)  # sorted by begin, disjoint
    _refused: int = -1
    index: TargetIndex = field(init=False)

    def __post_init__(self) -> None:
        self.index = TargetIndex(self.targets)
        self.targets = self.index.targets

    @property
    def direct(self) -> bool:
        return self.direct_fd >= 0

    def open(self, verify: bool) -> None:
        self.hasher = new_hasher() if verify else None
        try:
            self.fd = os.open(self.path, os.O_RDONLY | O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as exc:
            raise CorruptCheckpoint(
                f"checkpoint file {self.path} cannot be opened: {exc.strerror}", str(self.path)
            ) from exc
        info = os.fstat(self.fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size != self.size:
            raise CorruptCheckpoint(f"checkpoint file {self.path} changed while being opened", str(self.path))
        if O_DIRECT and cached_fraction(self.fd, self.size) < CACHED_ENOUGH:
            try:
                self.direct_fd = os.open(self.path, os.O_RDONLY | O_DIRECT | O_NOFOLLOW | os.O_NONBLOCK)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise

    def drop_direct(self) -> None:
        """Buffered reads from now on (the O_DIRECT descriptor stays open until `close`)."""
        self.direct_fd, self._refused = -1, self.direct_fd if self.direct_fd >= 0 else self._refused

    def close(self) -> None:
        for fd in (self.fd, self.direct_fd, self._refused):
            if fd >= 0:
                os.close(fd)
        self.fd = self.direct_fd = self._refused = -1

    def finish(self) -> None:
        if self.hasher is not None and self.hasher.hexdigest() != self.entry.checksum:
            raise CorruptCheckpoint(
                f"checkpoint file {self.path} fails its {self.entry.algorithm} checksum", str(self.path)
            )


def _pread(f: _File, view: memoryview, begin: int, end: int) -> None:
    """Fill `view` (len >= end - begin, page-aligned, page-rounded) with the file's bytes [begin, end)."""
    done, want = 0, end - begin
    while done < want:
        fd = f.direct_fd  # read once: another thread may drop O_DIRECT meanwhile
        direct = fd >= 0
        room = min(len(view), -(-want // DIRECT_ALIGN) * DIRECT_ALIGN) - done if direct else want - done
        with view[done : done + room] as piece:
            try:
                n = os.preadv(fd if direct else f.fd, [piece], begin + done)
            except OSError as exc:
                if not (direct and exc.errno == errno.EINVAL):
                    raise
                f.drop_direct()  # this file system refuses the alignment: buffered from here on
                continue
        if n <= 0:
            raise CorruptCheckpoint(f"checkpoint file {f.path} ended early at byte {begin + done}", str(f.path))
        done += n


def _preadv_all(f: _File, pieces: list[memoryview], offset: int) -> None:
    """Fill `pieces` with the file's bytes from `offset` on (buffered; the kernel copies straight into them)."""
    pending = [p for p in pieces if len(p)]
    while pending:
        n = os.preadv(f.fd, pending[:IOV_MAX], offset)
        if n <= 0:
            raise CorruptCheckpoint(f"checkpoint file {f.path} ended early at byte {offset}", str(f.path))
        offset += n
        while n and n >= len(pending[0]):
            n -= len(pending.pop(0))
        if n:
            pending[0] = pending[0][n:]


@dataclass(frozen=True)
class _Chunk:
    f: _File
    begin: int
    end: int
    slot: int  # sequence number modulo WINDOW: at most WINDOW chunks are in flight, so slots never collide


def _chunks(files: list[_File]) -> Iterator[_Chunk]:
    """Every chunk, files interleaved (one chunk of each in turn) so concurrent reads mostly hit different
    files sequentially (buffered readahead stays effective); each file's chunks stay in order."""
    starts = [range(0, f.size, CHUNK_BYTES) for f in files]
    seq = 0
    for i in range(max((len(r) for r in starts), default=0)):
        for f, begins in zip(files, starts, strict=True):
            if i < len(begins):
                yield _Chunk(f, begins[i], min(begins[i] + CHUNK_BYTES, f.size), seq % WINDOW)
                seq += 1


def _run(
    files: list[_File], verify: bool, land: Callable[[_Chunk], list[memoryview]], progress: Progress | None
) -> None:
    """Read every chunk of `files` (I/O threads), hash them in order here, then check each file's checksum.
    `land(chunk)` reads one chunk in an I/O thread and returns views of its bytes, in file order."""
    try:
        for f in files:
            f.open(verify)
        with ThreadPoolExecutor(IO_THREADS, thread_name_prefix="dcs-read") as pool:
            window: deque[tuple[_Chunk, Future[list[memoryview]]]] = deque()
            try:
                for chunk in _chunks(files):
                    if len(window) >= WINDOW:
                        _consume(*window.popleft(), progress)
                    window.append((chunk, pool.submit(land, chunk)))
                while window:
                    _consume(*window.popleft(), progress)
            finally:
                for _, future in window:
                    future.cancel()
        for f in files:
            f.finish()
    finally:
        for f in files:
            f.close()


def _consume(chunk: _Chunk, future: Future[list[memoryview]], progress: Progress | None) -> None:
    for piece in future.result():
        with piece:
            if chunk.f.hasher is not None:
                chunk.f.hasher.update(piece)
    if progress is not None:
        progress(chunk.f.entry.name, chunk.end, chunk.f.size)


def read_many(files: list[tuple[Path, FileEntry]], verify: bool, progress: Progress | None = None) -> list[mmap.mmap]:
    """Each file's bytes in its own fresh mapping (same order). Compressed files: `zread`."""
    if any(entry.compression for _, entry in files):
        return zread.read_many(files, verify, progress, read_many)
    opened = [_File(path, entry, checked_size(path, entry)) for path, entry in files]
    mappings = [anonymous(f.size + DIRECT_ALIGN) for f in opened]
    views = {id(f): memoryview(m) for f, m in zip(opened, mappings, strict=True)}

    def land(chunk: _Chunk) -> list[memoryview]:
        span = -(-(chunk.end - chunk.begin) // DIRECT_ALIGN) * DIRECT_ALIGN
        with views[id(chunk.f)][chunk.begin : chunk.begin + span] as view:
            _pread(chunk.f, view, chunk.begin, chunk.end)
        return [views[id(chunk.f)][chunk.begin : chunk.end]]

    try:
        _run(opened, verify, land, progress)
    finally:
        for view in views.values():
            view.release()
    return mappings


def read_scatter(
    files: list[tuple[Path, FileEntry, list[Target]]], verify: bool, progress: Progress | None = None
) -> None:
    """Read each file once, each byte landing in its target ((begin, end, writable bytes) ranges of the
    file; disjoint); with no targets this only verifies. Chunks with targets are read buffered with one
    `preadv` into the targets themselves (they are not aligned for O_DIRECT; measured: faster than O_DIRECT
    into a bounce buffer plus a copy), gaps into a scratch slot. If a file fails, earlier targets may
    already hold its bytes. Compressed files: `zread`."""
    if any(entry.compression for _, entry, _ in files):
        return zread.read_scatter(files, verify, progress, read_scatter)
    opened = [_File(path, entry, checked_size(path, entry), targets=targets) for path, entry, targets in files]
    slot_bytes = (
        min(CHUNK_BYTES, max((f.size for f in opened), default=0) + DIRECT_ALIGN) // DIRECT_ALIGN * DIRECT_ALIGN
    )
    scratch = anonymous(WINDOW * slot_bytes)
    whole = memoryview(scratch)

    def land(chunk: _Chunk) -> list[memoryview]:
        slot = whole[chunk.slot * slot_bytes : (chunk.slot + 1) * slot_bytes]
        if not chunk.f.targets:
            _pread(chunk.f, slot, chunk.begin, chunk.end)
            return [slot[: chunk.end - chunk.begin]]
        pieces = chunk.f.index.pieces(slot, chunk.begin, chunk.end)
        _preadv_all(chunk.f, pieces, chunk.begin)
        return pieces

    try:
        _run(opened, verify, land, progress)
    finally:
        whole.release()
