"""Checkpoint tasks (persist, commit, retention, replicate, the memory tier's flush and peer copy): thin Celery
drivers over the library (`dcs_tasks.checkpoint.persisting`, `.aftercommit`, `.replicating`, `.tiering`), with
this worker's `Runtime` as context. Payloads are the JSON models of `dcs_tasks.checkpoint.store.payloads`.

Flow: the trainer sends one persist per file to its host's node queue; the persist that records the last
file sends the commit to the same queue; the commit sends what `aftercommit.after_commit` names, each as a task
of its own on the same queue: for a memory step the peer copy and the flush (whose end sends the replica of the
stored step), for a storage step retention and the replicate task (task id `replica-<save token>`: one per
committed save attempt, so the result of a step's replication can be looked up by its token).

Payloads are untrusted: a malformed one fails with `InvalidTaskPayload`, and one naming a path outside this
worker's roots with `UntrustedPath` (`dcs_tasks.checkpoint.trust`), at once and never retried. A failed persist or
commit still fails its step in the ledger when the payload names one (run, step, token), so the waiting trainer
gets the reason; a partial step directory is removed only when it is the trusted one.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import shared_task

from dcs_tasks.celery_app import TaskName, node_queue
from dcs_tasks.checkpoint import aftercommit, replicating, tiering
from dcs_tasks.checkpoint.store.ledger.stepledger import FileOutcome, StepStatus, Verdict
from dcs_tasks.checkpoint.store.payloads import (
    CommitRequest,
    FailedTask,
    MemoryStepRequest,
    PersistRequest,
    ReplicateRequest,
    RetentionRequest,
)
from dcs_tasks.checkpoint.telemetry import record_error
from workers.commit import commit
from workers.persist import ledger, persist, remove_partial_step_at
from workers.runtime import runtime
from workers.taskbase import DCSTask, parse_payload

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
        # fenced by this task's id: a duplicate commit task failing cannot fail the commit another one claimed
        task_id = str(self.request.id)
        ledger().finish_commit(
            ref.run, ref.step, ref.token, StepStatus.FAILED, f"commit failed: {reason}", task_id=task_id
        )
        remove_partial_step_at(_step_dir_of(args[0]), ref.run, ref.step)


@shared_task(name=TaskName.PERSIST.value, base=PersistTask, bind=True)
def persist_file(self: PersistTask, payload: dict[str, Any]) -> str:
    """Persist one staged file; the call that completes the step's files enqueues the commit."""
    req = parse_payload(PersistRequest, payload, self.name)
    verdict = persist(req, str(self.request.id))
    if verdict is Verdict.COMMIT:
        body = CommitRequest(ref=req.ref, retention=req.retention, durable=req.durable)
        self.app.send_task(TaskName.COMMIT.value, args=[body.model_dump(mode="json")], queue=_local_queue())
    return verdict.value


@shared_task(name=TaskName.COMMIT.value, base=CommitTask, bind=True)
def commit_step(self: CommitTask, payload: dict[str, Any]) -> str:
    """Write the manifest and move `latest`; then send what follows the commit (`aftercommit.after_commit`)."""
    req = parse_payload(CommitRequest, payload, self.name)
    verdict = commit(req, str(self.request.id))
    if verdict is not Verdict.WRITE:
        return verdict.value
    follow = aftercommit.after_commit(runtime(), req)
    for name, body in (
        (TaskName.PEER_COPY, follow.peer_copy),
        (TaskName.FLUSH, follow.flush),
        (TaskName.RETENTION, follow.retention),
    ):
        if body is not None:
            self.app.send_task(name.value, args=[body.model_dump(mode="json")], queue=_local_queue())
    _send_replica(self, req.ref.token, follow.replica)
    return verdict.value


class MemoryTask(DCSTask):
    def give_up(self, args: Any, kwargs: Any, reason: str) -> None:
        record_error("checkpoint_memory_tier")
        payload = args[0] if args and isinstance(args[0], dict) else {}
        given = payload.get("ref")
        ref = given if isinstance(given, dict) else {}
        what = f"step {str(ref.get('step'))[:32]} of run {str(ref.get('run'))[:160]!r}"  # untrusted
        log.error("%s of %s failed (the step stays in memory): %s", self.name, what, reason)


class FlushTask(MemoryTask):
    def give_up(self, args: Any, kwargs: Any, reason: str) -> None:
        """Logged like any memory task's failure, and recorded for the trainer: the step is in memory only, so a
        save it asked to be durable is not (`dcs_tasks.checkpoint.failures`)."""
        super().give_up(args, kwargs, reason)
        failed = FailedTask.read(args[0] if args else None)
        if failed is not None:
            aftercommit.flush_failed(runtime(), failed.ref.run, failed.ref.step, reason)


@shared_task(name=TaskName.FLUSH.value, base=FlushTask, bind=True)
def flush_step(self: FlushTask, payload: dict[str, Any]) -> dict[str, Any]:
    """Copy a memory-tier step to storage (verified), move storage's `latest`, apply retention, send the replica."""
    req = parse_payload(MemoryStepRequest, payload, self.name)
    done = tiering.flush(runtime(), req, str(self.request.id))
    _send_replica(self, req.ref.token, aftercommit.after_flush(runtime(), req, done["storage"]))
    return done


@shared_task(name=TaskName.PEER_COPY.value, base=MemoryTask, bind=True)
def copy_to_peers(self: MemoryTask, payload: dict[str, Any]) -> dict[str, Any]:
    """Copy a memory-tier step to `memory_replicas` peers' memory, each verified on arrival."""
    return tiering.peer_copy(runtime(), parse_payload(MemoryStepRequest, payload, self.name))


def replica_task_id(token: str) -> str:
    """The replicate task's id for the save attempt `token` (its Celery result is kept under this id)."""
    return f"replica-{token}"


def _send_replica(task: DCSTask, token: str, body: ReplicateRequest | None) -> None:
    """Enqueue the replica of a step just committed (none without `body`). A failure to send is logged and
    counted: the commit stands (the replica is best effort; `dcs ckpt list` shows the step as primary only)."""
    if body is None:
        return
    try:
        task.app.send_task(
            TaskName.REPLICATE.value,
            args=[body.model_dump(mode="json")],
            queue=_local_queue(),
            task_id=replica_task_id(token),
        )
    except Exception as exc:  # the primary commit is done and must not fail because of its replica
        aftercommit.replica_not_sent(body.run, body.step, exc)


@shared_task(name=TaskName.RETENTION.value, base=DCSTask, bind=True)
def apply_retention(self: DCSTask, payload: dict[str, Any]) -> list[int]:
    """Delete the steps the run's retention policy lets go; returns them."""
    return aftercommit.retain(runtime(), parse_payload(RetentionRequest, payload, self.name))


class ReplicateTask(DCSTask):
    def give_up(self, args: Any, kwargs: Any, reason: str) -> None:
        record_error("checkpoint_replica")
        payload = args[0] if args and isinstance(args[0], dict) else {}
        what = f"step {str(payload.get('step'))[:32]} of run {str(payload.get('run'))[:160]!r}"  # untrusted
        log.error("replica of %s failed (the primary step stands): %s", what, reason)


@shared_task(name=TaskName.REPLICATE.value, base=ReplicateTask, bind=True)
def replicate_step(self: ReplicateTask, payload: dict[str, Any]) -> dict[str, Any]:
    """Copy a committed step to the replica root, verify it, move the replica's `latest`, apply retention."""
    done = replicating.replicate(runtime(), parse_payload(ReplicateRequest, payload, self.name), str(self.request.id))
    return {
        "step": done.step,
        "replica": str(done.replica_step_dir),
        "copied_bytes": done.copied_bytes,
        "deleted": done.deleted,
        "seconds": done.seconds,
    }
