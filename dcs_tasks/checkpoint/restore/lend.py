"""Lending a memory-tier step to a restore: its tmpfs files mapped, not read.

Without `into=` (`map_many`) the tensors are private copy-on-write mappings of the files' own pages (page tables
filled on every core); with `into=` (`copy_sealed`) the mappings are copied into the caller's tensors with
`memmove` on every core. A file that matches its seal (`store/tiers/seal.py`: hashed on arrival, unchanged since) is
not hashed again; any other is hashed after mapping (`nogil`: without the GIL, one file per core), so what was
checked is what the tensors hold. Each mapping holds a shared `flock` on its file for as long as it lives, and
the memory tier neither recycles nor overwrites a locked file (`durable.try_lock`). Files that cannot be lent
(compressed, being overwritten, replaced while opened) raise Unmappable: the caller reads them (`fileread`).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import stat
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

from dcs_tasks.checkpoint.format import nogil
from dcs_tasks.checkpoint.format.iosizes import READ_CHUNK_BYTES, READ_THREADS
from dcs_tasks.checkpoint.format.layout import FileEntry, new_hasher
from dcs_tasks.checkpoint.save.copier import HostCopier
from dcs_tasks.checkpoint.store.reads.fileread import O_NOFOLLOW, checked_size
from dcs_tasks.checkpoint.store.reads.landing import Target, anonymous
from dcs_tasks.checkpoint.store.tiers.seal import Stamp
from dcs_tasks.checkpoint.store.writes.durable import try_lock
from dcs_tasks.errors import CorruptCheckpoint

POPULATE_BYTES = 64 * 1024 * 1024  # one page-table fill of a lent file (pieces fill on several cores at once)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


class Unmappable(Exception):
    """`map_many` cannot lend this file's pages (compressed, locked by a writer, replaced while opened): read
    it with `read_many` instead."""


_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)


def _map_file(path: Path, entry: FileEntry, stamp: Stamp | None = None) -> tuple[mmap.mmap, bool]:
    """A private (copy-on-write) mapping of a memory-tier file under a shared lock that lives as long as the
    mapping (the mapping's own duplicate of the descriptor holds it), and whether the open file still matches
    its seal's `stamp` (`seal`: its bytes need no second hash)."""
    size = checked_size(path, entry)
    try:
        fd = os.open(path, os.O_RDONLY | O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise CorruptCheckpoint(f"checkpoint file {path} cannot be opened: {exc.strerror}", str(path)) from exc
    try:
        if not try_lock(fd, exclusive=False):
            raise Unmappable(f"{path} is being overwritten")
        info = os.fstat(fd)
        try:
            same = os.lstat(path).st_ino == info.st_ino  # not moved to the recycle pool before the lock
        except FileNotFoundError:
            same = False
        if not same or not stat.S_ISREG(info.st_mode) or info.st_size != size:
            raise Unmappable(f"{path} changed while being opened")
        sealed = stamp is not None and stamp.holds(info)
        return (mmap.mmap(fd, size, access=mmap.ACCESS_COPY) if size else anonymous(1)), sealed  # mmap refuses 0
    finally:
        os.close(fd)


def _address(mapping: mmap.mmap) -> int:
    anchor = ctypes.c_char.from_buffer(mapping)
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor  # the mapping stays closable; the address stays valid while it is open


def _populate(address: int, size: int) -> None:
    _libc.madvise(address, size, _MADV_POPULATE_READ)  # an old kernel refuses: pages fault on first touch


def _check(path: Path, entry: FileEntry, mapping: mmap.mmap) -> None:
    """Fill the mapping's page tables now (not on the trainer's first touch) and check its checksum, without the
    GIL where possible (`nogil`), so files map and verify on every core at once."""
    if entry.size == 0:
        found = new_hasher().hexdigest()
    else:
        address = _address(mapping)
        _populate(address, entry.size)
        if nogil.available():
            found = nogil.digest(address, entry.size)
        else:
            hasher = new_hasher()
            with memoryview(mapping) as whole, whole[: entry.size] as view:
                for pos in range(0, entry.size, READ_CHUNK_BYTES):
                    with view[pos : pos + READ_CHUNK_BYTES] as piece:
                        hasher.update(piece)
            found = hasher.hexdigest()
    if found != entry.checksum:
        raise CorruptCheckpoint(f"checkpoint file {path} fails its {entry.algorithm} checksum", str(path))


def _map_all(files: list[tuple[Path, FileEntry]], seals: Mapping[str, Stamp]) -> list[tuple[mmap.mmap, bool]]:
    mapped: list[tuple[mmap.mmap, bool]] = []
    try:
        for path, entry in files:
            mapped.append(_map_file(path, entry, seals.get(entry.name)))
    except BaseException:
        for mapping, _ in mapped:
            mapping.close()
        raise
    return mapped


_pools: dict[str, tuple[int, Any]] = {}


def _kept(name: str, make: Callable[[], Any]) -> Any:
    """A pool of this process kept for its later restores (starting threads costs a restore ~1 ms each); a
    forked child makes its own."""
    pid, pool = _pools.get(name, (-1, None))
    if pid != os.getpid():
        pool = make()
        _pools[name] = (os.getpid(), pool)
    return pool


def copier() -> HostCopier:
    """The process's `HostCopier` for restores (`copy_sealed`)."""
    return cast(HostCopier, _kept("copy", HostCopier))


def _in_parallel(jobs: list[Callable[[], None]]) -> None:
    if len(jobs) <= 1:
        for job in jobs:
            job()
        return
    pool = _kept("lend", lambda: ThreadPoolExecutor(READ_THREADS, thread_name_prefix="dcs-lend"))
    futures = [pool.submit(job) for job in jobs]
    try:
        for future in futures:
            future.result()
    finally:
        for future in futures:  # on an error, the rest must not run on after this returns
            future.cancel()
        for future in futures:
            if not future.cancelled():
                future.exception()  # waits


def _populate_jobs(mapping: mmap.mmap, size: int) -> list[Callable[[], None]]:
    """Page-table fills of `mapping` in `POPULATE_BYTES` pieces (several cores fill one big file)."""
    if size == 0:
        return []
    address = _address(mapping)
    return [
        functools.partial(_populate, address + pos, min(POPULATE_BYTES, size - pos))
        for pos in range(0, size, POPULATE_BYTES)
    ]


def map_many(
    files: list[tuple[Path, FileEntry]], verify: bool, seals: Mapping[str, Stamp] | None = None
) -> list[mmap.mmap]:
    """Each memory-tier file (tmpfs) lent to the caller without a copy: a private mapping of its pages, checked
    against its size and (`verify`) checksum after mapping, so what was verified is what the tensors hold. A file
    whose open descriptor matches its seal (`seals`, file name -> stamp: `seal.read_seals`) was hashed on arrival
    and is not hashed again. Writes to the tensors copy the touched pages (the file stays as committed); the
    file's pages live as long as the mapping, and the memory tier neither recycles nor overwrites a mapped file
    (`durable.try_lock`): once the step leaves memory its file is only deleted. Raises Unmappable (read the step with
    `read_many`) or CorruptCheckpoint."""
    if any(entry.compression for _, entry in files):
        raise Unmappable("compressed files are decoded, not mapped")
    mapped = _map_all(files, seals or {})
    try:
        jobs: list[Callable[[], None]] = []
        for (path, entry), (mapping, sealed) in zip(files, mapped, strict=True):
            if verify and not sealed:
                jobs.append(functools.partial(_check, path, entry, mapping))
            else:
                jobs += _populate_jobs(mapping, entry.size)
        _in_parallel(jobs)
    except BaseException:
        for mapping, _ in mapped:
            mapping.close()
        raise
    return [mapping for mapping, _ in mapped]


def copy_sealed(files: list[tuple[Path, FileEntry, list[Target]]], verify: bool, seals: Mapping[str, Stamp]) -> None:
    """`read_scatter` for a memory-tier step whose files all match their seals (or `verify` is False): each file
    mapped (under its shared lock) and copied into its targets with `memmove` on several cores, never hashed
    again. Raises Unmappable (nothing was written: read the step with `read_scatter`) when a file is compressed,
    being overwritten or, with `verify`, not sealed."""
    if any(entry.compression for _, entry, _ in files):
        raise Unmappable("compressed files are decoded, not mapped")
    unstamped = [path for path, entry, _ in files if entry.name not in seals]
    if verify and unstamped:  # known before mapping anything (memory_restore_verify="hash": no seals at all)
        raise Unmappable(f"{unstamped[0]} has no seal")
    mapped = _map_all([(path, entry) for path, entry, _ in files], seals)
    try:
        unsealed = [path for (path, _, _), (_, sealed) in zip(files, mapped, strict=True) if not sealed]
        if verify and unsealed:
            raise Unmappable(f"{unsealed[0]} does not match its seal")
        anchors: list[Any] = []
        fills: list[Callable[[], None]] = []
        jobs: list[tuple[int, int, int]] = []
        for (_, entry, targets), (mapping, _) in zip(files, mapped, strict=True):
            if not any(end > begin for begin, end, _ in targets):
                continue
            fills += _populate_jobs(mapping, entry.size)
            source = _address(mapping)
            for begin, end, dest in targets:
                if end > begin:
                    anchor = (ctypes.c_char * len(dest)).from_buffer(dest)
                    anchors.append(anchor)
                    jobs.append((ctypes.addressof(anchor), source + begin, end - begin))
        try:
            _in_parallel(fills)  # page tables first, in one batch per piece: faulting page by page in memmove is slower
            copier().copy(jobs)
        finally:
            del anchors
    finally:
        _close_later([mapping for mapping, _ in mapped])


def _close_later(mappings: list[mmap.mmap]) -> None:
    """Close mappings on a background thread: unmapping 256 MiB of page tables takes ~3 ms, which a restore
    need not wait for (the shared locks they hold go with them)."""
    unmapper = _kept("unmap", lambda: ThreadPoolExecutor(1, thread_name_prefix="dcs-unmap"))
    for mapping in mappings:
        unmapper.submit(mapping.close)
