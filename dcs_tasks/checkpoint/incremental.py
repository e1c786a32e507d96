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
import stat
from collections.abc import Iterator
from pathlib import Path

from dcs_tasks.checkpoint.format import MANIFEST_NAME, FileEntry, Manifest, new_hasher
from dcs_tasks.checkpoint.fsio import locked
from dcs_tasks.checkpoint.iosizes import WRITE_CHUNK_BYTES
from dcs_tasks.errors import CorruptCheckpoint

REFS_LOCK_NAME = ".refs.lock"
RETIRED_NAME = ".retired"
_CACHE_MAX = 4  # parsed base manifests kept per process (one per run a worker child serves, roughly)
_manifests: dict[tuple[str, int, int, int], Manifest] = {}


@contextlib.contextmanager
def refs_lock(run_dir: Path, shared: bool) -> Iterator[None]:
    """The run's reference lock (shared: a persist task recording a reference; exclusive: retention). Released
    by the kernel when the holder dies, so a killed worker never leaves it held."""
    with locked(run_dir, REFS_LOCK_NAME, shared=shared):  # never through a symlink (UntrustedPath)
        yield


def is_retired(step_dir: Path) -> bool:
    return os.path.lexists(step_dir / RETIRED_NAME)


def base_manifest(step_dir: Path) -> tuple[int, Manifest] | None:
    """The newest committed step before `step_dir`'s own in the same run directory whose manifest checks, as
    (step, manifest); None when there is none. Parsed manifests are cached by inode and mtime."""
    from dcs_tasks.checkpoint.reader import STEP_DIR, load_manifest, step_dirs

    match = STEP_DIR.match(step_dir.name)
    own = int(match.group(1)) if match else -1
    for step, candidate in reversed(step_dirs(step_dir.parent)):
        if step >= own:
            continue
        try:
            return step, _cached_manifest(candidate, load_manifest)
        except (CorruptCheckpoint, OSError):
            continue
    return None


def _cached_manifest(step_dir: Path, load: object) -> Manifest:
    found = (step_dir / MANIFEST_NAME).lstat()
    key = (str(step_dir), found.st_ino, found.st_mtime_ns, found.st_size)
    manifest = _manifests.get(key)
    if manifest is None:
        assert callable(load)
        manifest = load(step_dir)
        if len(_manifests) >= _CACHE_MAX:
            _manifests.pop(next(iter(_manifests)))
        _manifests[key] = manifest
    return manifest


def candidate(step_dir: Path, name: str, size: int) -> FileEntry | None:
    """The entry this step would record if its file `name` of `size` bytes equals the newest earlier step's:
    that step's entry, referring to the step holding the bytes, whose file is there as a regular file of that
    size. None when there is no such file (then the file is written)."""
    base = base_manifest(step_dir)
    if base is None:
        return None
    step, manifest = base
    entry = next((f for f in manifest.files if f.name == name and f.size == size), None)
    if entry is None:
        return None
    reused = entry.referring(step)
    held = reused.stored_path(step_dir)
    try:
        found = held.lstat()
    except OSError:
        return None
    return reused if stat.S_ISREG(found.st_mode) and found.st_size == entry.disk_size else None


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
