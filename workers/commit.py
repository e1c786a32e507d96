"""Commit one step: write `manifest.json` durably, move `latest`, mark the step COMMITTED.

The step directory is checked against this worker's checkpoint root first (`workers.trust`): an untrusted
one fails the task with `UntrustedPath` before the ledger is touched or anything is written. Fenced by the
ledger: only the task id that claimed the commit writes, a COMMITTED step is never
rewritten, and a redelivered commit that finds its manifest already on disk keeps it (the manifest is a
pure function of the ledger, so its bytes would not change anyway).

Metrics (recorded here, where the save becomes durable, once per committed step): `dcs_ckpt_commit_seconds`
(this task's work) and the originally named `dcs_save_latency_seconds` / `dcs_bytes_saved_total` /
`dcs_save_operations_total`, whose latency runs from the save's begin in the ledger to this commit.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from dcs_tasks.checkpoint.format import LATEST_NAME, MANIFEST_NAME, Manifest, manifest_bytes, step_dir_name
from dcs_tasks.checkpoint.fsio import remove_stray_temps, write_bytes_durably
from dcs_tasks.checkpoint.latest import move_latest
from dcs_tasks.checkpoint.ledger import StepStatus, Verdict
from dcs_tasks.checkpoint.models import CommitRequest
from dcs_tasks.checkpoint.reader import read_latest
from dcs_tasks.checkpoint.telemetry import record_commit, record_durable_save
from dcs_tasks.errors import CheckpointFailed
from dcs_tasks.storage import ObjectPath
from workers.objlocks import run_lock
from workers.persist import ledger
from workers.runtime import runtime
from workers.trust import trusted_step_dir

log = logging.getLogger(__name__)


def commit(req: CommitRequest, task_id: str) -> Verdict:
    """Returns WRITE when this call committed the step, otherwise why it did nothing."""
    ref = req.ref
    step_dir = trusted_step_dir(ref.step_dir, ref.run, ref.step, runtime().config)
    book = ledger()
    verdict = book.claim_commit(ref.run, ref.step, ref.token, task_id)
    if verdict is not Verdict.WRITE:
        log.info("commit %s step %d: %s, nothing to do", ref.run, ref.step, verdict.value)
        return verdict
    started = time.monotonic()
    state = book.read(ref.run, ref.step)
    manifest = Manifest(**state.manifest_draft().model_dump(), files=[state.files[n] for n in sorted(state.files)])
    if isinstance(step_dir, ObjectPath):
        publish_object_step(step_dir, manifest, ref.step)
    else:
        check_files(step_dir, manifest)
        remove_stray_temps(step_dir)
        final = step_dir / MANIFEST_NAME
        if not final.exists():
            write_bytes_durably(final, manifest_bytes(manifest), task_id)
        move_latest(step_dir.parent, ref.step, task_id)
    if book.finish_commit(ref.run, ref.step, ref.token, StepStatus.COMMITTED, task_id=task_id) is Verdict.OK:
        record_commit(time.monotonic() - started)
        # durable latency: the trainer's begin (wall clock, this host: node queues are per host) to now
        record_durable_save(manifest.total_bytes, time.time() - manifest.created_at)
    return verdict


def check_files(step_dir: Path, manifest: Manifest) -> None:
    for entry in manifest.files:
        path = entry.stored_path(step_dir)
        size = path.stat().st_size if path.is_file() else -1
        if size != entry.disk_size:
            raise CheckpointFailed(f"cannot commit: {path} has {size} bytes, expected {entry.disk_size}")


def publish_object_step(step_dir: ObjectPath, manifest: Manifest, step: int) -> None:
    """Commit a step kept in an object store: every file object has its recorded size, uploads still open under
    the step (a delivery that died mid-upload) are aborted, then `manifest.json` (one PUT: a reader lists steps
    by their manifests, so the step appears whole) and last `latest`."""
    for entry in manifest.files:
        path = entry.stored_path(step_dir)
        size = path.size()
        if size != entry.disk_size:
            raise CheckpointFailed(f"cannot commit: {path} has {size} bytes, expected {entry.disk_size}")
    step_dir.store.abort_uploads(step_dir.key + "/")
    final = step_dir / MANIFEST_NAME
    if final.size() is None:
        final.store.put_small(final.key, manifest_bytes(manifest))
    move_object_latest(step_dir.parent, step)


def move_object_latest(run_dir: ObjectPath, step: int) -> None:
    """Point the run's `latest` object at `step` unless it names a newer (or the same) step, under the run's
    `latest` lock (workers/objlocks.py)."""
    with run_lock(run_dir, "latest"):
        current = read_latest(run_dir)
        if current is not None and current >= step:
            return
        latest = run_dir / LATEST_NAME
        latest.store.put_small(latest.key, f"{step_dir_name(step)}\n".encode())
