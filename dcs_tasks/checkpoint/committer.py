"""Writing and publishing a step's bytes: the one protocol every committer follows, on either store.

Two committers use it: the worker's persist and commit tasks (`workers/persist.py`, `workers/commit.py`) and
`dcs ckpt import` (`dcs_tasks/interop/writer.py`). Both get the same pre-publish checks and the same order:
1. `write_file`: one file's bytes, complete or not at all under their final name, checksummed on the same pass
   (files: temp name, fsync, rename, directory fsync, zstd when asked; object stores: a multipart upload that
   appears only once complete). `publish`, asked just before the bytes appear, may refuse (a redelivery whose
   file another delivery already recorded: NotPublished / NotPublishedObject).
2. `publish_step`: the manifest is checked as restore will check it (`validate.check_manifest`), every stored
   file has its recorded size, leftovers of dead writers are removed (temp files; open multipart uploads), the
   manifest is written (one atomic rename or PUT: a reader lists a step by its manifest, so it appears whole),
   and last `latest` moves forward, never back (`latest.move_latest`, under the run's `latest` lock: `Store.lock`,
   an flock on `<run>/.latest.lock` on files; in an object store the run's lock in Redis, `store/ledger/objlocks.py`).
3. `remove_partial_step`: a step that failed before its manifest is removed (never a committed one, nor a
   retired one whose files later steps use).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import mmap
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dcs_tasks.checkpoint.format.compression import CompressionSpec, probe_saving
from dcs_tasks.checkpoint.format.layout import (
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    manifest_bytes,
    new_hasher,
)
from dcs_tasks.checkpoint.format.validate import check_manifest
from dcs_tasks.checkpoint.store.ledger import incremental
from dcs_tasks.checkpoint.store.ledger.latest import move_latest
from dcs_tasks.checkpoint.store.writes.zwrite import compress_into, write_region
from dcs_tasks.errors import CheckpointFailed
from dcs_tasks.storage import Location, ObjectPath, store_of
from dcs_tasks.storage.objpath import MAX_FOLDER_OBJECTS

log = logging.getLogger(__name__)

ObjectLock = Callable[[ObjectPath, str], contextlib.AbstractContextManager[None]]
"""(run location, purpose) -> a held lock: `objlocks.run_lock` bound to a Redis client."""


def write_file(
    source_fd: int,
    offset: int,
    length: int,
    final: Location,
    tag: str,
    *,
    compression: CompressionSpec | None = None,
    threads: int = 0,
    throttle: float | None = None,
    publish: Callable[[], bool] | None = None,
    recycled: Path | None = None,
) -> FileEntry:
    """Store `length` bytes at `offset` (page-aligned) of the open file `source_fd` as the step file `final`;
    returns its manifest entry (zstd-compressed as `<name>.zst` when `compression` asks and the bytes shrink
    enough, on either store). `recycled`: a file to overwrite instead of a new one (files only; the memory
    tier's, `store/writes/durable.durable_file`)."""
    store = store_of(final)
    local = store.local_path(final)
    if local is not None:  # a local file: streamed from the staging file with O_DIRECT (recycled, zstd in place)
        source = Path(f"/proc/self/fd/{source_fd}")
        return write_region(source, offset, length, local, tag, compression, threads, throttle, publish, recycled)
    if compression is not None and length > 0:  # elsewhere: put from the staging mapping (`Store.put`)
        packed = _upload_compressed(source_fd, offset, length, final, compression, threads, throttle, publish)
        if packed is not None:
            return packed
    return _upload(source_fd, offset, length, final, tag, publish, throttle)


def _upload(
    fd: int,
    offset: int,
    length: int,
    final: Location,
    tag: str,
    publish: Callable[[], bool] | None,
    throttle: float | None,
) -> FileEntry:
    hasher = new_hasher()
    store = store_of(final)
    if length == 0:  # nothing to map
        store.put(final, memoryview(b""), tag, hasher=hasher, publish=publish)
    else:
        mapping = mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ, offset=offset)
        try:
            with memoryview(mapping) as view:
                store.put(final, view, tag, hasher=hasher, publish=publish, on_bytes=pacer(throttle))
        finally:
            mapping.close()
    return FileEntry(name=final.name, size=length, checksum=str(hasher.hexdigest()))


def _upload_compressed(
    fd: int,
    offset: int,
    length: int,
    final: Location,
    spec: CompressionSpec,
    threads: int,
    throttle: float | None,
    publish: Callable[[], bool] | None,
) -> FileEntry | None:
    """zstd-compress the region into memory (a memfd) and upload it as `<name>.zst`; None when the probe says
    the bytes do not shrink enough (then they are uploaded as they are)."""
    mapping = mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ, offset=offset)
    try:
        with memoryview(mapping) as view:
            if spec.min_saving > 0 and probe_saving(view, spec.level) < spec.min_saving:
                return None
            packed = os.memfd_create("dcs-zstd", os.MFD_CLOEXEC)
            try:
                checksum, stored = compress_into(view, packed, spec, threads, throttle)
                entry = FileEntry(
                    name=final.name, size=length, checksum=checksum, compression=spec.codec, stored_size=stored
                )
                target = entry.stored_path(final.parent)
                out = mmap.mmap(packed, stored, mmap.MAP_SHARED, mmap.PROT_READ)
                try:
                    with memoryview(out) as body:
                        store_of(target).put(target, body, "zst", publish=publish)
                finally:
                    out.close()
            finally:
                os.close(packed)
    finally:
        mapping.close()
    return entry


def pacer(throttle: float | None) -> Callable[[int], None] | None:
    """An `on_bytes` callback that sleeps so the upload goes no faster than `throttle` bytes/s (fault tests)."""
    if throttle is None:
        return None
    import time

    began, done = time.monotonic(), [0]

    def pace(n: int) -> None:
        done[0] += n
        ahead = done[0] / throttle - (time.monotonic() - began)
        if ahead > 0:
            time.sleep(ahead)

    return pace


def committed(step_dir: Location) -> bool:
    """Whether the step's manifest is stored (the step exists for readers)."""
    manifest = step_dir / MANIFEST_NAME
    return store_of(manifest).file_exists(manifest)


def check_stored(step_dir: Location, manifest: Manifest) -> dict[str, int]:
    """Every file of `manifest` is stored with its recorded size (CheckpointFailed names the first that is not):
    one listing of each folder the files lie in (the step's own, and the earlier steps' that incremental
    references point into), then a `stat` (a HEAD) only for a file the listing does not show with its size (an
    object store's listing may lag a write on some servers; a HEAD does not). Returns what the listings showed
    (location as text -> size)."""
    paths = [entry.stored_path(step_dir) for entry in manifest.files]
    listed: dict[str, int] = {}
    for folder in {str(p.parent): p.parent for p in paths}.values():
        found = store_of(folder).files(folder, MAX_FOLDER_OBJECTS)
        listed.update({str(folder / name): size for name, size in found.items()})
    for entry, path in zip(manifest.files, paths, strict=True):
        size = listed.get(str(path))
        if size != entry.disk_size:
            size = store_of(path).stat(path)
            size = -1 if size is None else size
        if size != entry.disk_size:
            raise CheckpointFailed(f"cannot commit: {path} has {size} bytes, expected {entry.disk_size}")
    return listed


def publish_step(step_dir: Location, manifest: Manifest, tag: str, object_lock: ObjectLock | None = None) -> None:
    """Make the step visible: checks, leftovers removed, manifest, then `latest` (module doc). A manifest already
    stored is kept (a redelivered commit: it is a pure function of the ledger, so its bytes would not change).
    The sweep of what dead writers left (`Store.sweep`: temp files, open multipart uploads) runs beside the size
    checks, whose listing of the step also says whether its manifest is stored (a manifest a lagging listing
    missed is written again with the same bytes: the rule above makes that harmless); a failed check fails the
    step, whose leftovers are swept anyway. `object_lock`: the run's `latest` lock where the store has no locks
    of its own (an object store: `Store.lock` raises NoLock without it)."""
    check_manifest(manifest, step_dir / MANIFEST_NAME)  # what restore will check, before the step is visible
    store, final = store_of(step_dir), step_dir / MANIFEST_NAME
    with ThreadPoolExecutor(1, thread_name_prefix="dcs-publish") as pool:
        swept = pool.submit(store.sweep, step_dir)  # temp files; open multipart uploads
        listed = check_stored(step_dir, manifest)  # on failure the pool's exit still waits for the sweep
        swept.result()
    write = None if str(final) in listed else functools.partial(store.write_small, final, manifest_bytes(manifest), tag)
    move_latest(step_dir.parent, manifest.step, tag, fence=object_lock, first=write)  # `latest` read beside the write


def remove_partial_step(step_dir: Location) -> None:
    """Delete a step that never got a manifest (a failed save); never a committed one, nor a retired one (a
    deleted step whose files later steps still use). In an object store: its objects and any upload still open
    under it."""
    if committed(step_dir) or incremental.is_retired(step_dir):
        return
    store = store_of(step_dir)
    store.sweep(step_dir)  # what writers left unpublished: open uploads, temp files
    store.delete_tree(step_dir)
    log.info("removed partial step %s", step_dir)
