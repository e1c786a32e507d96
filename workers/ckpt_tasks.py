"""Checkpoint tasks (persist, commit, retention): thin Celery wrappers over `workers.persist`,
`workers.commit` and `workers.retention`. Payloads are the JSON models of `dcs_tasks.checkpoint.models`.

Flow: the trainer sends one persist per file to its host's node queue; the persist that records the last
file sends the commit to the same queue; the commit sends retention when the run has a policy.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from celery import shared_task

from dcs_tasks.celery_app import TaskName, node_queue
from dcs_tasks.checkpoint.ledger import FileOutcome, StepStatus, Verdict
from dcs_tasks.checkpoint.models import CommitRequest, PersistRequest, RetentionRequest
from dcs_tasks.checkpoint.telemetry import record_error
from workers.base import DCSTask
from workers.commit import commit
from workers.persist import finish, ledger, persist, remove_partial_step
from workers.retention import retain
from workers.runtime import runtime

log = logging.getLogger(__name__)


def _local_queue() -> str:
    return node_queue(runtime().config.host_name)


class PersistTask(DCSTask):
    def give_up(self, args: Any, kwargs: Any, reason: str) -> None:
        record_error("checkpoint_persist")
        req = PersistRequest.model_validate(args[0])
        finish(req, FileOutcome.FAILED, f"persisting {req.file_name} failed: {reason}")


class CommitTask(DCSTask):
    def give_up(self, args: Any, kwargs: Any, reason: str) -> None:
        record_error("checkpoint_commit")
        ref = CommitRequest.model_validate(args[0]).ref
        ledger().finish_commit(ref.run, ref.step, ref.token, StepStatus.FAILED, f"commit failed: {reason}")
        remove_partial_step(Path(ref.step_dir))


@shared_task(name=TaskName.PERSIST.value, base=PersistTask, bind=True)
def persist_file(self: PersistTask, payload: dict[str, Any]) -> str:
    """Persist one staged file; the call that completes the step's files enqueues the commit."""
    req = PersistRequest.model_validate(payload)
    verdict = persist(req, str(self.request.id))
    if verdict is Verdict.COMMIT:
        body = CommitRequest(ref=req.ref, retention=req.retention)
        self.app.send_task(TaskName.COMMIT.value, args=[body.model_dump(mode="json")], queue=_local_queue())
    return verdict.value


@shared_task(name=TaskName.COMMIT.value, base=CommitTask, bind=True)
def commit_step(self: CommitTask, payload: dict[str, Any]) -> str:
    """Write the manifest and move `latest`; then enqueue retention when the run has a policy."""
    req = CommitRequest.model_validate(payload)
    verdict = commit(req, str(self.request.id))
    if verdict is Verdict.WRITE and req.retention.active:
        body = RetentionRequest(run=req.ref.run, run_dir=str(Path(req.ref.step_dir).parent), policy=req.retention)
        self.app.send_task(TaskName.RETENTION.value, args=[body.model_dump(mode="json")], queue=_local_queue())
    return verdict.value


@shared_task(name=TaskName.RETENTION.value, base=DCSTask, bind=True)
def apply_retention(self: DCSTask, payload: dict[str, Any]) -> list[int]:
    """Delete the steps the run's retention policy lets go; returns them."""
    return retain(RetentionRequest.model_validate(payload))
