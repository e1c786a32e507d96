"""Replicate one committed step to the replica root (`replica_dir`): the `dcs.ckpt.replicate` task's work, run by
`workers/ckpt_tasks.py` (with the worker's `Runtime` as context) or by an in-process committer's threads
(`dcs_tasks.checkpoint.inline`); the order of what follows a commit is `dcs_tasks.checkpoint.aftercommit`'s.

The replica is the same relative tree under another root (`<replica_dir>/<run>/step-.../`, a rank's part
under `<replica_dir>/<run>/rank-0000r/step-.../`), so a file an incremental step refers to in an earlier
step (`FileEntry.stored_path`) resolves inside the replica too; such a file is copied there when the
earlier step was never replicated.

Durable and verified, manifest last: each file is streamed to a temp name (O_DIRECT where the filesystem
allows it), hashed on the same pass and compared with the manifest's checksum (a primary file that does not
match is not replicated), fsynced and renamed; then the whole replica step is read back and verified
(`reader.verify_step`: sizes, headers, checksums of the bytes on the replica's disk); only then is
`manifest.json` written (temp, fsync, rename) and the replica's `latest` moved forward. A step without its
manifest does not exist for readers, so a copy cut short (kill -9, power loss) is never restored.

Idempotent under redelivery: a file already at its final name with its size is kept (final names only
appear after fsync + rename) and verified with the rest; a replica step whose manifest is already there and
whose files check is not copied again. Retention then applies the run's policy to the replica run directory.

Failures are the replica's alone: `ReplicaFailed` (not writable, primary gone or corrupt, copy does not
verify) fails this copy, never the primary commit; the caller logs the reason and counts
`dcs_errors_total{error_type="checkpoint_replica"}`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from dcs_tasks.checkpoint import persisting
from dcs_tasks.checkpoint.format.layout import MANIFEST_NAME, FileEntry, Manifest, new_hasher
from dcs_tasks.checkpoint.format.validate import MAX_MANIFEST_BYTES
from dcs_tasks.checkpoint.persisting import Context
from dcs_tasks.checkpoint.restore.reader import load_manifest, verify_step
from dcs_tasks.checkpoint.store.ledger.latest import move_latest
from dcs_tasks.checkpoint.store.ledger.retention import apply_retention, regular_of_size
from dcs_tasks.checkpoint.store.payloads import ReplicateRequest, RetentionPolicy
from dcs_tasks.checkpoint.store.reads.landing import anonymous
from dcs_tasks.checkpoint.store.reads.stepcheck import check_files, read_small
from dcs_tasks.checkpoint.store.writes.durable import (
    stream_region,
)
from dcs_tasks.checkpoint.telemetry import record_replica
from dcs_tasks.checkpoint.trust import checkpoint_root, replica_root, trusted_step_dir
from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import CorruptCheckpoint, ReplicaFailed, UntrustedPath
from dcs_tasks.storage import Location, store_of
from dcs_tasks.storage.factory import relative, within
from dcs_tasks.storage.fs import make_dirs_durable
from dcs_tasks.storage.store import Refused

log = logging.getLogger(__name__)

# errors that mean "this location cannot be written", not "try again later": the task fails at once
UNWRITABLE = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EEXIST, errno.ELOOP, errno.EISDIR}


@dataclass(frozen=True)
class ReplicaResult:
    step: int
    replica_step_dir: Location
    copied_bytes: int  # 0 when a redelivery found the replica complete
    deleted: list[int]  # replica steps retention let go
    seconds: float


def replicate(ctx: Context, req: ReplicateRequest, task_id: str) -> ReplicaResult:
    """Copy, verify and publish the replica of `req`'s step; ReplicaFailed names why it could not."""
    config = ctx.config
    src_dir, dst_dir = _trusted_dirs(config, req)
    started = time.monotonic()
    manifest = primary_manifest(src_dir)
    copied = 0
    if not complete(dst_dir, manifest):
        try:
            copied = copy_step(src_dir, dst_dir, manifest, task_id, config.checkpoint.persist_throttle_bytes_per_second)
        except OSError as exc:
            if exc.errno in UNWRITABLE:
                raise ReplicaFailed(f"replica of step {req.step} of run {req.run!r} cannot be written: {exc}") from exc
            raise  # transient (ENOSPC, EIO): retried by the task base
    deleted = publish_copy(ctx, dst_dir, req.run, req.step, req.retention, task_id)
    seconds = time.monotonic() - started
    record_replica(seconds, copied)
    log.info(
        "replicated step %d of run %s to %s (%d bytes copied, %.3f s)", req.step, req.run, dst_dir, copied, seconds
    )
    return ReplicaResult(req.step, dst_dir, copied, deleted, seconds)


def publish_copy(
    ctx: Context, dst_dir: Location, run: str, step: int, retention: RetentionPolicy, task_id: str
) -> list[int]:
    """After a step was copied to `dst_dir` (a replica, or the memory tier's flush to storage): move that run
    directory's `latest` forward and apply `retention` there; the steps retention let go."""
    run_lock = persisting.object_lock(ctx)
    move_latest(dst_dir.parent, step, task_id, fence=run_lock)  # an object store's latest lock: in Redis
    if not retention.active:
        return []
    in_flight = persisting.ledger(ctx).in_flight_steps(run)
    return apply_retention(dst_dir.parent, retention, in_flight, object_lock=lambda where: run_lock(where, "refs"))


def _trusted_dirs(config: DCSConfig, req: ReplicateRequest) -> tuple[Location, Location]:
    """(primary step dir, replica step dir): each under its own root, at the same relative path."""
    replica = replica_root(config)
    if replica is None:
        raise ReplicaFailed(f"this worker has no replica_dir: cannot replicate step {req.step} of run {req.run!r}")
    primary = checkpoint_root(config)
    if within(replica, primary) or within(primary, replica):
        raise ReplicaFailed(f"replica_dir {str(replica)!r} overlaps checkpoint_dir {str(primary)!r}")
    src_dir = trusted_step_dir(req.step_dir, req.run, req.step, config, root=primary)
    dst_dir = trusted_step_dir(req.replica_step_dir, req.run, req.step, config, root=replica)
    if relative(src_dir, primary) != relative(dst_dir, replica):
        raise UntrustedPath(f"replica step directory {req.replica_step_dir[:256]!r} does not mirror {req.step_dir!r}")
    return src_dir, dst_dir


def _exists(path: Location) -> bool:
    return store_of(path).exists(path)


def primary_manifest(src_dir: Location) -> Manifest:
    """The primary step's manifest, its files checked (sizes, headers); ReplicaFailed when gone or corrupt."""
    if not _exists(src_dir / MANIFEST_NAME):
        raise ReplicaFailed(f"primary step {src_dir} has no manifest (deleted before it was replicated?)")
    try:
        manifest = load_manifest(src_dir)
        check_files(src_dir, manifest)
    except CorruptCheckpoint as exc:
        raise ReplicaFailed(f"primary step is corrupt, not replicated: {exc}") from exc
    return manifest


def complete(dst_dir: Location, manifest: Manifest) -> bool:
    """Whether an earlier delivery finished this replica: its manifest is there and its files check."""
    if not _exists(dst_dir / MANIFEST_NAME):
        return False
    try:
        check_files(dst_dir, load_manifest(dst_dir))
    except CorruptCheckpoint as exc:
        log.warning("replica %s is damaged (%s): copying it again", dst_dir, exc)
        _remove(dst_dir / MANIFEST_NAME)
        return False
    return load_manifest(dst_dir).files == manifest.files


def _remove(path: Location) -> None:
    store_of(path).delete([path])


def copy_step(
    src_dir: Location,
    dst_dir: Location,
    manifest: Manifest,
    tag: str,
    throttle: float | None = None,
    read_back: bool = True,
) -> int:
    """Copy every file of the checked primary step `src_dir` to `dst_dir` (durably, hashed on the way and compared
    with the manifest), verify the copy as read back (`read_back`; the memory tier's flush skips it: its writes
    are checked as a save's are, hashed while written), then write its manifest last; returns the bytes copied.
    No Redis, no `latest` (bench/replica.py times this). Either side may be an object store (`_copy_across`)."""
    store_of(dst_dir).make_folder(dst_dir)
    copied = sum(_copy_file(entry, src_dir, dst_dir, tag, throttle) for entry in manifest.files)
    try:
        if read_back:
            verify_step(dst_dir, manifest)
        else:
            check_files(dst_dir, manifest)  # sizes and headers as stored
    except CorruptCheckpoint as exc:
        under = str(dst_dir.parent) + "/"
        if exc.path and exc.path.startswith(under):
            with contextlib.suppress(ValueError):  # not a name this run could hold: nothing to remove
                _remove(dst_dir.parent / exc.path[len(under) :])  # a redelivery copies it again
        raise ReplicaFailed(f"replica of {src_dir.name} does not verify after copying: {exc}") from exc
    raw = read_small(src_dir / MANIFEST_NAME, MAX_MANIFEST_BYTES)
    store = store_of(dst_dir)
    store.sweep(dst_dir)  # temp files or open uploads of deliveries that died
    store.write_small(dst_dir / MANIFEST_NAME, raw, tag)
    return copied


def _own_directory(step_dir: Path) -> None:
    """UntrustedPath unless `step_dir` (an earlier step of the replica run an incremental file refers to) is
    absent or a real directory right where it is named: a symlink planted at `<replica>/<run>/step-N` would
    send the copy (and the verification read) to wherever it points. `dst_dir` is resolved by the trust
    check, so its run directory holds no symlink itself."""
    try:
        found = step_dir.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(found.st_mode) or step_dir.resolve() != step_dir:
        raise UntrustedPath(f"replica step directory {str(step_dir)!r} is a symlink or not a directory: not written")


def _copy_file(entry: FileEntry, src_dir: Location, dst_dir: Location, tag: str, throttle: float | None) -> int:
    """Copy one file's stored bytes unless already there; returns the bytes copied."""
    src_at, dst_at = entry.stored_path(src_dir), entry.stored_path(dst_dir)
    src, dst = store_of(src_at).local_path(src_at), store_of(dst_at).local_path(dst_at)
    if src is None or dst is None:  # not file to file: through the stores
        return _copy_across(entry, src_at, dst_at, tag)
    size = src.lstat().st_size  # check_files made it a regular file of the manifest's size
    if dst.parent != dst_dir:
        _own_directory(dst.parent)  # before anything is read or written through it
    if regular_of_size(dst, size):
        return 0  # an earlier delivery, or an earlier replicated step this one refers to: verified below
    if dst.parent != dst_dir:
        make_dirs_durable(dst.parent)  # an incremental reference into a step not replicated itself
        _own_directory(dst.parent)
    digest = stream_region(src, 0, size, dst, tag, throttle)
    if entry.compression is None and digest != entry.checksum:
        dst.unlink(missing_ok=True)
        raise ReplicaFailed(f"primary file {src} does not match its manifest checksum: not replicated")
    return size


def _copy_across(entry: FileEntry, src: Location, dst: Location, tag: str) -> int:
    """Copy one file between a file system and an object store (either way), hashed on the way and compared
    with the manifest before it is published; returns the bytes copied (0 when already there)."""
    size = entry.disk_size
    if regular_of_size(dst, size):
        return 0  # an earlier delivery, or an earlier replicated step this one refers to: verified after
    hasher = new_hasher()
    source, target = store_of(src), store_of(dst)
    local = source.local_path(src)
    if local is not None:  # mapped, not copied
        with open(local, "rb") as f:
            mapping = mmap.mmap(f.fileno(), size, mmap.MAP_SHARED, mmap.PROT_READ) if size else mmap.mmap(-1, 1)
    else:  # the stored bytes (compressed ones as they are), into memory
        mapping = anonymous(size)
        with memoryview(mapping)[:size] as raw:
            source.read_into(src, 0, [raw])

    def matches() -> bool:  # asked once every byte is stored and hashed, before the copy appears
        return entry.compression is not None or hasher.hexdigest() == entry.checksum  # compressed: verify_step

    try:
        with memoryview(mapping)[:size] as view:
            target.make_folder(dst.parent)
            target.put(dst, view, tag, hasher=hasher, publish=matches)  # parallel parts; a file: durable write
    except Refused:
        raise ReplicaFailed(f"primary file {src} does not match its manifest checksum: not replicated") from None
    finally:
        mapping.close()
    return size
