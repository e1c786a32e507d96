"""Checkpoint tasks (persist, commit, retention): thin Celery wrappers over `workers.persist`,
`workers.commit` and `workers.retention`. Payloads are the JSON models of `dcs_tasks.checkpoint.models`.

Flow: the trainer sends one persist per file to its host's node queue; the persist that records the last
file sends the commit to the same queue; the commit sends retention when the run has a policy.

Payloads are untrusted: a malformed one fails with `InvalidTaskPayload`, and one naming a path outside this
worker's roots with `UntrustedPath` (`workers.trust`), at once and never retried. A failed persist or commit
still fails its step in the ledger when the payload names one (run, step, token), so the waiting trainer
gets the reason; a partial step directory is removed only when it is the trusted one.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from celery import shared_task

from dcs_tasks.celery_app import TaskName, node_queue
from dcs_tasks.checkpoint.ledger import FileOutcome, StepStatus, Verdict
from dcs_tasks.checkpoint.models import CommitRequest, FailedTask, PersistRequest, RetentionRequest
from dcs_tasks.checkpoint.telemetry import record_error
from workers.base import DCSTask, parse_payload
from workers.commit import commit
from workers.persist import ledger, persist, remove_partial_step_at
from workers.retention import retain
from workers.runtime import runtime

log = logging.getLogger(__name__)


def _step_dir_of(payload: Any) -> object:
    ref = payload.get("ref") if isinstance(payload, dict) else None
    return ref.get("step_dir") if isinstance(ref, dict) else None


def _local_queue() -> str:
    return node_queue(runtime().config.host_name)


class PersistTask(DCSTask):
    def give_up(self, args: Any, kwargs: Any, reason: str) -> None:
        record_error("checkpoint_persist")
        failed = FailedTask.read(args[0] if args else None)
        if failed is None:
            log.error("persist payload names no step: nothing to fail in the ledger")
            return
        ref = failed.ref
        if failed.file_name is None:  # no file to count: fail the whole attempt
            ledger().abandon(ref.run, ref.step, ref.token, f"persist task refused: {reason}")
            return
        value = f"persisting {failed.file_name} failed: {reason}"
        result = ledger().finish_file(ref.run, ref.step, ref.token, failed.file_name, FileOutcome.FAILED, value)
        if result.all_finished and result.status is StepStatus.FAILED:
            remove_partial_step_at(_step_dir_of(args[0]), ref.run, ref.step)


class CommitTask(DCSTask):
    def give_up(self, args: Any, kwargs: Any, reason: str) -> None:
        record_error("checkpoint_commit")
        failed = FailedTask.read(args[0] if args else None)
        if failed is None:
            log.error("commit payload names no step: nothing to fail in the ledger")
            return
        ref = failed.ref
        ledger().finish_commit(ref.run, ref.step, ref.token, StepStatus.FAILED, f"commit failed: {reason}")
        remove_partial_step_at(_step_dir_of(args[0]), ref.run, ref.step)


@shared_task(name=TaskName.PERSIST.value, base=PersistTask, bind=True)
def persist_file(self: PersistTask, payload: dict[str, Any]) -> str:
    """Persist one staged file; the call that completes the step's files enqueues the commit."""
    req = parse_payload(PersistRequest, payload, self.name)
    verdict = persist(req, str(self.request.id))
    if verdict is Verdict.COMMIT:
        body = CommitRequest(ref=req.ref, retention=req.retention)
        self.app.send_task(TaskName.COMMIT.value, args=[body.model_dump(mode="json")], queue=_local_queue())
    return verdict.value


@shared_task(name=TaskName.COMMIT.value, base=CommitTask, bind=True)
def commit_step(self: CommitTask, payload: dict[str, Any]) -> str:
    """Write the manifest and move `latest`; then enqueue retention when the run has a policy."""
    req = parse_payload(CommitRequest, payload, self.name)
    verdict = commit(req, str(self.request.id))
    if verdict is Verdict.WRITE and req.retention.active:
        body = RetentionRequest(run=req.ref.run, run_dir=str(Path(req.ref.step_dir).parent), policy=req.retention)
        self.app.send_task(TaskName.RETENTION.value, args=[body.model_dump(mode="json")], queue=_local_queue())
    return verdict.value


@shared_task(name=TaskName.RETENTION.value, base=DCSTask, bind=True)
def apply_retention(self: DCSTask, payload: dict[str, Any]) -> list[int]:
    """Delete the steps the run's retention policy lets go; returns them."""
    return retain(parse_payload(RetentionRequest, payload, self.name))
