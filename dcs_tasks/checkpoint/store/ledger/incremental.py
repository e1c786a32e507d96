"""Incremental saves: a file whose staged bytes equal the same-named file of the newest earlier committed step
is not written again; the new manifest refers to the step that physically holds the bytes (`source_step`).

Granularity is the file (see docs/checkpoints.md, Incremental saves): every reader already reads and verifies
whole files through `FileEntry.stored_path`, and a file's xxh3_128 is already in the manifest, so the worker
decides by hashing the staged region (several GB/s, from tmpfs, far faster than the disk write it replaces)
and comparing it with the earlier entry of the same name and size.

References and retention share one lock per run directory (`flock` on `<run>/.refs.lock`): a persist task
holds it shared from choosing a source until the reference is recorded in the ledger; retention holds it
exclusive while it marks what kept and in-flight steps refer to and deletes the rest. So a file is never
deleted between being chosen and being recorded.

A deleted step whose files later steps still use is *retired*: a `.retired` marker is written first, then the
manifest is removed (the step no longer exists for readers) and every file no kept step refers to; the
directory goes once nothing refers to it. A save never writes into a retired directory.
"""

from __future__ import annotations

import contextlib
import mmap
import os

from dcs_tasks.checkpoint.format.iosizes import WRITE_CHUNK_BYTES
from dcs_tasks.checkpoint.format.layout import MANIFEST_NAME, STEP_DIR, FileEntry, Manifest, new_hasher
from dcs_tasks.checkpoint.store.ledger.steps import step_dirs
from dcs_tasks.checkpoint.store.reads.stepcheck import read_manifest
from dcs_tasks.errors import CorruptCheckpoint, StorageError
from dcs_tasks.storage import Location, store_of
from dcs_tasks.storage.store import Fence

REFS_LOCK = "refs"
REFS_LOCK_NAME = f".{REFS_LOCK}.lock"  # its lock file in a run directory on files
RETIRED_NAME = ".retired"
_CACHE_MAX = 4  # parsed base manifests kept per process (one per run a worker child serves, roughly)
_manifests: dict[tuple[str, int, int, int], Manifest] = {}


def refs_lock(run_dir: Location, shared: bool, fence: Fence | None = None) -> contextlib.AbstractContextManager[None]:
    """The run's reference lock (shared: a persist task recording a reference; exclusive: retention), through its
    store (`Store.lock`): on files `<run>/.refs.lock`, released by the kernel when the holder dies, so a killed
    worker never leaves it held (never through a symlink: UntrustedPath); in an object store `fence`, the run's
    `refs` lock in Redis (exclusive either way, with a lease)."""
    return store_of(run_dir).lock(run_dir, REFS_LOCK, shared=shared, fence=fence)


def is_retired(step_dir: Location) -> bool:
    marker = step_dir / RETIRED_NAME
    return store_of(marker).file_exists(marker)


def base_manifest(step_dir: Location) -> tuple[int, Manifest] | None:
    """The newest committed step before `step_dir`'s own in the same run directory whose manifest checks, as
    (step, manifest); None when there is none. Parsed manifests are cached by inode and mtime."""
    found = _earlier_steps(step_dir)
    for step, candidate in reversed(found):
        try:
            return step, _cached_manifest(candidate, read_manifest)
        except (CorruptCheckpoint, OSError, StorageError):
            continue
    return None


def _earlier_steps(step_dir: Location) -> list[tuple[int, Location]]:
    """The committed steps of `step_dir`'s run before its own, oldest first."""
    match = STEP_DIR.match(step_dir.name)
    own = int(match.group(1)) if match else -1
    return [(step, where) for step, where in step_dirs(step_dir.parent) if step < own]


def _cached_manifest(step_dir: Location, load: object) -> Manifest:
    local = store_of(step_dir).local_path(step_dir)
    if local is None:  # an object: committed manifests are never rewritten; a deleted one is gone
        size = store_of(step_dir).stat(step_dir / MANIFEST_NAME)
        if size is None:
            raise CorruptCheckpoint(f"{step_dir}/{MANIFEST_NAME} is gone", str(step_dir))
        key = (str(step_dir), -1, -1, size)
    else:
        found = (local / MANIFEST_NAME).lstat()
        key = (str(step_dir), found.st_ino, found.st_mtime_ns, found.st_size)
    manifest = _manifests.get(key)
    if manifest is None:
        assert callable(load)
        manifest = load(step_dir)
        if len(_manifests) >= _CACHE_MAX:
            _manifests.pop(next(iter(_manifests)))
        _manifests[key] = manifest
    return manifest


def candidate(step_dir: Location, name: str, size: int, full_every: int | None = None) -> FileEntry | None:
    """The entry this step would record if its file `name` of `size` bytes equals the newest earlier step's:
    that step's entry, referring to the step holding the bytes, whose file is there as a regular file (or an
    object) of that size. None when there is no such file (then the file is written).

    `full_every` (K): a file is written anew once K - 1 committed steps after the one holding its bytes
    already refer to it, so one damaged file never takes more than K steps with it (failure isolation)."""
    earlier = _earlier_steps(step_dir)
    base = None
    for step, where in reversed(earlier):
        try:
            base = step, _cached_manifest(where, _load_manifest)
            break
        except (CorruptCheckpoint, OSError, StorageError):
            continue
    if base is None:
        return None
    step, manifest = base
    entry = next((f for f in manifest.files if f.name == name and f.size == size), None)
    if entry is None:
        return None
    reused = entry.referring(step)
    holder = reused.source_step
    if full_every is not None and holder is not None:
        users = sum(1 for s, _ in earlier if s > holder)  # committed steps since the holder, all may refer to it
        if users + 1 >= full_every:
            return None
    held = reused.stored_path(step_dir)
    return reused if store_of(held).stat(held) == entry.disk_size else None


def _load_manifest(step_dir: Location) -> Manifest:
    return read_manifest(step_dir)


SAMPLES = 8
SAMPLE_BYTES = 4096


def surely_differs(fd: int, offset: int, length: int, held: Location, entry: FileEntry) -> bool:
    """True when a few samples (`SAMPLES` x 4 KiB spread over the file) of the staged region differ from the
    held file's (plain files only): a state whose bytes all changed then costs a few small reads instead of a
    full hash of the region before it is written. False means "maybe equal": hash the whole region."""
    if entry.compression or length < SAMPLES * SAMPLE_BYTES:
        return False
    starts = sorted({(length - SAMPLE_BYTES) * i // (SAMPLES - 1) for i in range(SAMPLES)})
    try:
        for start in starts:
            staged = os.pread(fd, SAMPLE_BYTES, offset + start)
            stored = bytearray(SAMPLE_BYTES)
            store_of(held).read_into(held, start, [memoryview(stored)])
            if staged != bytes(stored):
                return True
    except (OSError, StorageError, CorruptCheckpoint):
        return False  # cannot tell: the full hash decides
    return False


def region_checksum(fd: int, offset: int, length: int) -> str:
    """xxh3_128 of `length` bytes at `offset` of the open staging file `fd` (the checksum a write would record)."""
    hasher = new_hasher()
    if length == 0:
        return str(hasher.hexdigest())
    mapping = mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ, offset=offset)
    try:
        view = memoryview(mapping)
        try:
            for pos in range(0, length, WRITE_CHUNK_BYTES):
                with view[pos : pos + WRITE_CHUNK_BYTES] as piece:
                    hasher.update(piece)
        finally:
            view.release()
    finally:
        mapping.close()
    return str(hasher.hexdigest())


def referenced(manifest: Manifest) -> set[tuple[int, str]]:
    """(step, file name) of every file `manifest` takes from an earlier step."""
    return {(f.source_step, f.name) for f in manifest.files if f.source_step is not None}
