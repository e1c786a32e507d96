"""Commit one step: write `manifest.json` durably, move `latest`, mark the step COMMITTED
(`dcs_tasks.checkpoint.committer.publish_step`, the protocol `dcs ckpt import` follows too).

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

from dcs_tasks.checkpoint.committer import publish_step
from dcs_tasks.checkpoint.format import Manifest
from dcs_tasks.checkpoint.ledger import StepStatus, Verdict
from dcs_tasks.checkpoint.models import CommitRequest
from dcs_tasks.checkpoint.telemetry import record_commit, record_durable_save
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
    publish_step(step_dir, manifest, task_id, object_lock=run_lock)
    if book.finish_commit(ref.run, ref.step, ref.token, StepStatus.COMMITTED, task_id=task_id) is Verdict.OK:
        record_commit(time.monotonic() - started)
        # durable latency: the trainer's begin (wall clock, this host: node queues are per host) to now
        record_durable_save(manifest.total_bytes, time.time() - manifest.created_at)
    return verdict
