"""Persist and commit, the worker side of a save: the `dcs.ckpt.persist` / `dcs.ckpt.commit` tasks' work, run
by `workers/` (a prefork child, with the worker's `Runtime` as context) or in the trainer's own process
(`dcs_tasks.checkpoint.inline`, Redis still real).

Persist: claim the file in the ledger, stream it durably with its checksum, record it. The staging file and the
step directory are checked against the context's configured roots first (`checkpoint.trust`): an untrusted path
fails with `UntrustedPath` before anything is read, written or claimed. Idempotent: a file already recorded, a
file claimed by another task id, or a step that is no longer PERSISTING is not written again (a stale or
duplicate delivery changes no bytes). The call that records the last file returns COMMIT.

Incremental saves (`req.incremental`, `dcs_tasks.checkpoint.store.ledger.incremental`): before writing, the
staged region is compared with the newest earlier committed step's file of the same name and size; when equal
nothing is written and the earlier entry is recorded with `source_step`.

Commit: write `manifest.json`, move `latest`, mark the step COMMITTED (`committer.publish_step`, the protocol
`dcs ckpt import` follows too), fenced by the ledger: only the task id that claimed the commit writes, a
COMMITTED step is never rewritten, and a redelivered commit that finds its manifest stored keeps it.
Metrics (recorded where the save becomes durable, once per committed step): `dcs_ckpt_commit_seconds` and
`dcs_save_latency_seconds` / `dcs_bytes_saved_total` / `dcs_save_operations_total`, whose latency runs from
the save's begin in the ledger to this commit.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import redis

from dcs_tasks.checkpoint import committer
from dcs_tasks.checkpoint.committer import ObjectLock, committed, publish_step
from dcs_tasks.checkpoint.format.layout import FileEntry, Manifest
from dcs_tasks.checkpoint.store.ledger import incremental, objlocks
from dcs_tasks.checkpoint.store.ledger.stepledger import (
    FileFinish,
    FileOutcome,
    StepLedger,
    StepStatus,
    Verdict,
    file_entry_json,
)
from dcs_tasks.checkpoint.store.payloads import CommitRequest, PersistRequest
from dcs_tasks.checkpoint.store.tiers import memdir, seal
from dcs_tasks.checkpoint.store.writes.durable import NotPublished
from dcs_tasks.checkpoint.telemetry import record_commit, record_durable_save, record_persist
from dcs_tasks.checkpoint.trust import open_staging, trusted_save_dir, trusted_staging_path
from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import CheckpointFailed, InvalidTaskPayload, UntrustedPath
from dcs_tasks.keys import Keys
from dcs_tasks.storage import Location, ObjectPath, store_of
from dcs_tasks.storage.store import Refused

log = logging.getLogger(__name__)

# how long a write waits for its step's checks (two HEADs, each bounded by the S3 client's timeouts and retries)
GUARD_TIMEOUT_SECONDS = 600.0


class Context(Protocol):
    """What persisting needs of its process: the worker's `Runtime`, or an in-process committer's."""

    @property
    def config(self) -> DCSConfig: ...
    @property
    def redis(self) -> redis.Redis: ...
    @property
    def keys(self) -> Keys: ...


def ledger(ctx: Context) -> StepLedger:
    return StepLedger(ctx.redis, ctx.keys)


def object_lock(ctx: Context) -> ObjectLock:
    """The run locks of object-store runs, on `ctx`'s Redis."""

    def lock(where: ObjectPath, purpose: str) -> contextlib.AbstractContextManager[None]:
        return objlocks.run_lock(ctx.redis, ctx.keys, where, purpose)

    return lock


@dataclass(frozen=True)
class PersistPaths:
    """The paths of a persist request, checked against this worker's roots (resolved)."""

    staging: Path
    step_dir: Location


def trusted_paths(ctx: Context, req: PersistRequest) -> PersistPaths:
    """Raises UntrustedPath unless both paths of `req` lie where this worker's config puts them
    (InvalidTaskPayload for an offset no staging region has)."""
    config = ctx.config
    if req.offset % mmap.ALLOCATIONGRANULARITY:  # staging regions are page-aligned; mmap refuses others
        raise InvalidTaskPayload(f"offset {req.offset} of {req.file_name} is not a multiple of the page size")
    ref = req.ref
    return PersistPaths(
        staging=trusted_staging_path(req.staging_path, ref.run, config),
        step_dir=trusted_save_dir(ref.step_dir, ref.run, ref.step, config),
    )


def persist(ctx: Context, req: PersistRequest, task_id: str) -> Verdict:
    """Write `req`'s file if this task may; returns COMMIT when this call completed the step's files."""
    paths = trusted_paths(ctx, req)
    ref = req.ref
    book = ledger(ctx)
    verdict = book.claim_file(ref.run, ref.step, ref.token, req.file_name, task_id)
    if verdict is Verdict.CLOSED:  # the step failed meanwhile: count this file as finished, write nothing
        finish(ctx, req, FileOutcome.SKIPPED, "step no longer persisting")
        return verdict
    if verdict is Verdict.DONE and book.progress(ref.run, ref.step)[0] is StepStatus.COMMITTING:
        return Verdict.COMMIT  # a retry after the commit could not be sent: send it (commits are fenced)
    if verdict is not Verdict.WRITE:
        log.info("persist %s/%s step %d: %s, nothing to do", ref.run, req.file_name, ref.step, verdict.value)
        return verdict
    started = time.monotonic()
    step_dir = paths.step_dir
    guard = step_guard(step_dir, ref.token)
    if req.incremental:
        guard()
        with _refs_lock(ctx, step_dir.parent):  # retention waits until the reference is recorded
            reused = reusable(ctx, req, paths.staging, step_dir)
            if reused is not None:
                store_of(step_dir).make_folder(step_dir)  # the commit writes the manifest there
                record_persist(time.monotonic() - started)
                log.info(
                    "persist %s/%s step %d: bytes equal step %s's, not written",
                    ref.run,
                    req.file_name,
                    ref.step,
                    reused.source_step,
                )
                return finish(ctx, req, FileOutcome.OK, file_entry_json(reused)).verdict
    try:
        entry = write_file(ctx, req, task_id, paths, guard)
    except (NotPublished, Refused):
        # the file is no longer open: another delivery recorded it (finishing again changes nothing), or the step
        # failed meanwhile (then this file must still be counted, or the step's files never all finish and the
        # save's staging buffer is never handed back)
        log.info(
            "persist %s/%s step %d: no longer open (recorded elsewhere, or the step failed), this copy dropped",
            ref.run,
            req.file_name,
            ref.step,
        )
        finish(ctx, req, FileOutcome.SKIPPED, "not published: the file was no longer open")
        return Verdict.DONE
    log.info(
        "persisted %s of %s step %d to %s: %d bytes%s in %.2fs",
        req.file_name,
        ref.run,
        ref.step,
        step_dir,
        entry.size,
        f" as {entry.disk_size} {entry.compression}" if entry.compression else "",
        time.monotonic() - started,
    )
    record_persist(time.monotonic() - started)
    return finish(ctx, req, FileOutcome.OK, file_entry_json(entry)).verdict


@contextlib.contextmanager
def _refs_lock(ctx: Context, run_dir: Location) -> Iterator[None]:
    """The run's reference lock, shared (`incremental.refs_lock`: `.refs.lock` on files, Redis in an object
    store). A run directory that does not exist yet has no earlier step to refer to: nothing to lock."""
    with contextlib.ExitStack() as held:
        with contextlib.suppress(FileNotFoundError):
            held.enter_context(incremental.refs_lock(run_dir, shared=True, fence=object_lock(ctx)))
        yield


def reusable(ctx: Context, req: PersistRequest, staging: Path, step_dir: Location) -> FileEntry | None:
    """The newest earlier step's entry for this file when the staged bytes equal it (hashed from the staging
    file before anything is written), else None. A few samples are compared first, so a file whose bytes all
    changed is not hashed twice (once here, once while it is written). The worker's
    `incremental_full_every` bounds how many steps one stored file serves (`incremental.candidate`)."""
    entry = incremental.candidate(
        step_dir, req.file_name, req.length, full_every=ctx.config.checkpoint.incremental_full_every
    )
    if entry is None:
        return None
    fd = _open_staging(ctx, staging)
    try:
        _check_staged_size(fd, req, staging)
        if incremental.surely_differs(fd, req.offset, req.length, entry.stored_path(step_dir), entry):
            return None
        checksum = incremental.region_checksum(fd, req.offset, req.length)
    finally:
        os.close(fd)
    return entry if checksum == entry.checksum else None


def step_guard(step_dir: Location, token: str = "") -> Callable[[], None]:
    """The checks that a step may still be written into: not committed (the ledger forgot a committed step:
    never write into it) and not retired (a deleted step whose files later steps use). The two look-ups (HEADs
    in an object store) start now, side by side, and the returned call (made before the file appears, and
    before an incremental reuse) waits for them: the upload's first parts travel meanwhile, and a refusal
    aborts it, so nothing becomes visible. The returned call raises CheckpointFailed.

    A step that passed for one file of a save (`token`: the save's ledger token) passes for the save's other
    files in this process without asking again: while the save persists, only its own commit writes the step's
    manifest, and retention never marks a step that is not committed."""
    seen = (str(step_dir), token)
    if token and seen in _clean_steps:
        return lambda: None
    pool = ThreadPoolExecutor(2, thread_name_prefix="dcs-step-guard")
    try:
        found = [pool.submit(committed, step_dir), pool.submit(incremental.is_retired, step_dir)]
    finally:
        pool.shutdown(wait=False)

    def wait() -> None:
        _refuse(step_dir, *(f.result(timeout=GUARD_TIMEOUT_SECONDS) for f in found))
        if token:
            with _clean_lock:
                _clean_steps[seen] = None
                while len(_clean_steps) > CLEAN_STEPS_KEPT:
                    del _clean_steps[next(iter(_clean_steps))]

    return wait


# (step, save token) pairs whose checks passed in this process, oldest first (step_guard)
_clean_steps: dict[tuple[str, str], None] = {}
_clean_lock = threading.Lock()
CLEAN_STEPS_KEPT = 256


def _refuse(step_dir: Location, is_committed: bool, is_retired: bool) -> None:
    if is_committed:
        raise CheckpointFailed(
            f"{step_dir} is already committed (its manifest.json exists) though the ledger has no record of "
            "it (expired or lost with Redis's data): DCS never overwrites a committed step; save under a new step"
        )
    if is_retired:
        raise CheckpointFailed(
            f"{step_dir} still holds files that later steps use (a deleted step's); save under a new step"
        )


def write_file(
    ctx: Context, req: PersistRequest, task_id: str, paths: PersistPaths, guard: Callable[[], None] = lambda: None
) -> FileEntry:
    """Store the staged region as the step's file and checksum it (`committer.write_file`: temp, fsync, rename,
    dir fsync on files, zstd-compressed when the request asks and the bytes shrink; a multipart upload on object
    stores). The staging file is opened once without following symlinks and read through that descriptor. Just
    before the bytes appear the ledger must still show the file open (`StepLedger.file_open`), else NotPublished:
    two deliveries of one task can overlap (a retry beside the restored original), and the later one must not
    replace a file the first recorded, since the save's staging buffer may have been released and reused
    meanwhile."""
    staging = paths.staging
    fd = _open_staging(ctx, staging)
    try:
        _check_staged_size(fd, req, staging)
        store_of(paths.step_dir).make_folder(paths.step_dir)
        config = ctx.config
        ref = req.ref
        book = ledger(ctx)

        def still_open() -> bool:  # a redelivery may overlap the first delivery (same task id): see NotPublished
            guard()
            return book.file_open(ref.run, ref.step, ref.token, req.file_name)

        recycled = None
        if req.compression is None and _in_memory_tier(config, paths.step_dir):
            # a memory-tier step: reuse the pages of one that left
            recycled = memdir.take_recycled(memdir.memory_root(config), req.length)
        return committer.write_file(
            fd,
            req.offset,
            req.length,
            paths.step_dir / req.file_name,
            task_id,
            compression=req.compression,
            threads=config.checkpoint.compression_threads,
            throttle=config.checkpoint.persist_throttle_bytes_per_second,
            publish=still_open,
            recycled=recycled,
        )
    finally:
        os.close(fd)


def _in_memory_tier(config: DCSConfig, step_dir: Location) -> bool:
    return memdir.in_memory_tier(config, step_dir)


def _open_staging(ctx: Context, staging: Path) -> int:
    try:
        return open_staging(staging)
    except FileNotFoundError as exc:
        host = ctx.config.host_name
        raise CheckpointFailed(
            f"staging file {staging} is not on host {host!r}: the trainer closed or crashed, or it staged it on "
            "another host (a trainer's node name must be the host it runs on)"
        ) from exc


def _check_staged_size(fd: int, req: PersistRequest, staging: Path) -> None:
    staged_size = os.fstat(fd).st_size
    if staged_size < req.offset + req.length:
        raise CheckpointFailed(f"staging file {staging} has {staged_size} bytes, needs {req.offset + req.length}")


def finish(ctx: Context, req: PersistRequest, outcome: FileOutcome, value: str) -> FileFinish:
    """Record the file's final outcome; the last finisher of a FAILED step removes its partial directory."""
    ref = req.ref
    result = ledger(ctx).finish_file(ref.run, ref.step, ref.token, req.file_name, outcome, value)
    if result.all_finished and result.status is StepStatus.FAILED:
        remove_partial_step_at(ctx, ref.step_dir, ref.run, ref.step)
    return result


def remove_partial_step_at(ctx: Context, step_dir: object, run: str, step: int) -> None:
    """`remove_partial_step` of a payload's step directory, only when it is trusted (else nothing is touched)."""
    try:
        if not isinstance(step_dir, str):
            raise UntrustedPath(f"step directory {str(step_dir)[:256]!r} is not a path")
        trusted = trusted_save_dir(step_dir, run, step, ctx.config)
    except UntrustedPath as exc:
        log.warning("not removing the partial directory of %s step %d: %s", run, step, exc)
        return
    remove_partial_step(trusted)


def remove_partial_step(step_dir: Location) -> None:
    """`committer.remove_partial_step`: a failed save's step, never a committed or retired one."""
    committer.remove_partial_step(step_dir)


def commit(ctx: Context, req: CommitRequest, task_id: str) -> Verdict:
    """Returns WRITE when this call committed the step, otherwise why it did nothing."""
    ref = req.ref
    step_dir = trusted_save_dir(ref.step_dir, ref.run, ref.step, ctx.config)
    book = ledger(ctx)
    verdict = book.claim_commit(ref.run, ref.step, ref.token, task_id)
    if verdict is not Verdict.WRITE:
        log.info("commit %s step %d: %s, nothing to do", ref.run, ref.step, verdict.value)
        return verdict
    started = time.monotonic()
    state = book.read(ref.run, ref.step)
    manifest = Manifest(**state.manifest_draft().model_dump(), files=[state.files[n] for n in sorted(state.files)])
    local = store_of(step_dir).local_path(step_dir)
    if local is not None and _in_memory_tier(ctx.config, local):  # hashed on the way in: sealed, so restores
        seal.seal_step(local, [f.stored_path(local).name for f in manifest.files])  # need not hash again
    publish_step(step_dir, manifest, task_id, object_lock=object_lock(ctx))
    if book.finish_commit(ref.run, ref.step, ref.token, StepStatus.COMMITTED, task_id=task_id) is Verdict.OK:
        record_commit(time.monotonic() - started)
        # durable latency: the trainer's begin (wall clock, this host: node queues are per host) to now
        record_durable_save(manifest.total_bytes, time.time() - manifest.created_at)
    return verdict
