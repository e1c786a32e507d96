"""Persist and commit in the trainer's own process: `Checkpointer(run, config, celery_app=InlineCommitter(config))`.

What a host's `dcs worker` does for a save (`dcs_tasks.checkpoint.persisting`: trust checks, ledger claims,
durable writes or uploads, incremental references, the commit; then what follows a commit,
`dcs_tasks.checkpoint.aftercommit`: retention, replicas to `replica_dir`, and with the memory tier the commit in
memory, the flush of every Nth step to storage, the copies to peers and eviction), run by this process's own
threads instead of Celery tasks, calling the same library functions. Redis stays real: the ledger fences every
write exactly as with workers, so a worker and an inline committer can even serve the same run. For tests of the
save path that need no worker process, and for single-process jobs (a notebook, a CI job) that want checkpoints
without running a worker; a training fleet runs `dcs worker`: a trainer that dies takes its inline saves in
flight (and their flushes and replica copies) with it (the ledger then fails unfinished saves after
`abandoned_save_seconds`), while a worker's are redelivered.

`send_task` takes the calls `Checkpointer` makes (the persist task's name and JSON payload, as Celery would get
it); a persist or commit that raises is retried with the worker's policy (`dcs_tasks.retrypolicy`: storage or
Redis errors, backoff, `task.max_retries`, the same task id), and one that still fails fails its file or the step
with the reason, as a task that gives up does; a flush that raises is recorded for the trainer's next save() as
the worker's flush task does (`aftercommit.flush_failed`); a replica or peer copy that raises is logged and
counted, the commit stands.

Peer copies (`memory_replicas` > 0) are pushed from these threads to the peer servers registered in Redis by the
`dcs worker`s of other hosts, as a worker's peer-copy task does. An inline committer runs no peer server itself:
it receives no copies of other hosts' steps, and a restore on another host cannot pull this process's memory
steps (it uses the peers' copies or storage).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import redis

from dcs_tasks.celery_app import TaskName
from dcs_tasks.checkpoint import aftercommit, persisting, replicating, tiering
from dcs_tasks.checkpoint.store.ledger.stepledger import FileOutcome, StepStatus, Verdict
from dcs_tasks.checkpoint.store.payloads import (
    CommitRequest,
    MemoryStepRequest,
    PersistRequest,
    ReplicateRequest,
    RetentionRequest,
)
from dcs_tasks.checkpoint.telemetry import record_error
from dcs_tasks.config import DCSConfig
from dcs_tasks.keys import Keys
from dcs_tasks.redisconn import sync_client
from dcs_tasks.retrypolicy import retry_delay

log = logging.getLogger(__name__)


class InlineCommitter:
    """A stand-in for the Celery app a `Checkpointer` sends its persist tasks to, running them here."""

    inline = True  # Checkpointer: no worker presence to check

    def __init__(self, config: DCSConfig, threads: int = 2) -> None:
        self.config = config
        self.keys = Keys(config.redis.namespace)
        self.redis: redis.Redis = sync_client(config)
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="dcs-inline")
        self._lock = threading.Lock()
        self._futures: list[Future[None]] = []

    def send_task(self, name: str, args: list[Any] | None = None, **_: Any) -> None:
        if name != TaskName.PERSIST.value or not args:
            raise ValueError(f"an inline committer runs persist tasks only, not {name!r}")
        self._submit(self._persist, args[0], uuid.uuid4().hex)

    def _submit(self, job: Callable[..., None], *args: Any) -> None:
        with self._lock:
            self._futures = [f for f in self._futures if not f.done()]
            self._futures.append(self._pool.submit(job, *args))

    def _persist(self, payload: dict[str, Any], task_id: str) -> None:
        req = PersistRequest.model_validate(payload)
        try:
            verdict = self._retrying(
                f"persist of {req.file_name} step {req.ref.step}", persisting.persist, req, task_id
            )
        except Exception as exc:
            log.warning("inline persist of %s step %d failed: %s", req.file_name, req.ref.step, exc)
            reason = f"persisting {req.file_name} failed: {type(exc).__name__}: {exc}"
            persisting.finish(self, req, FileOutcome.FAILED, reason[:2000])
            return
        if verdict is Verdict.COMMIT:
            body = CommitRequest(ref=req.ref, retention=req.retention, durable=req.durable)
            self._commit(body, uuid.uuid4().hex)

    def _commit(self, req: CommitRequest, task_id: str) -> None:
        ref = req.ref
        try:
            verdict = self._retrying(f"commit of {ref.run!r} step {ref.step}", persisting.commit, req, task_id)
        except Exception as exc:
            log.warning("inline commit of %s step %d failed: %s", ref.run, ref.step, exc)
            reason = f"commit failed: {type(exc).__name__}: {exc}"[:2000]
            persisting.ledger(self).finish_commit(
                ref.run, ref.step, ref.token, StepStatus.FAILED, reason, task_id=task_id
            )
            persisting.remove_partial_step_at(self, ref.step_dir, ref.run, ref.step)
            return
        if verdict is Verdict.WRITE:
            follow = aftercommit.after_commit(self, req)
            for job, body in (
                (self._peer_copy, follow.peer_copy),
                (self._flush, follow.flush),
                (self._retain, follow.retention),
                (self._replicate, follow.replica),
            ):
                if body is not None:
                    self._submit(job, body)

    def _retrying(
        self, what: str, call: Callable[[InlineCommitter, Any, str], Verdict], req: Any, task_id: str
    ) -> Verdict:
        """`call(self, req, task_id)`, tried again (same task id) after the worker's backoff while it raises what
        `dcs_tasks.retrypolicy` retries and retries are left; the last error is raised."""
        retries = 0
        while True:
            try:
                return call(self, req, task_id)
            except Exception as exc:
                delay = retry_delay(exc, retries, self.config.task)
                if delay is None:
                    raise
                retries += 1
                record_error("task_retry")
                log.warning("inline %s: retry %d in %.2fs: %s: %s", what, retries, delay, type(exc).__name__, exc)
                time.sleep(delay)

    def _flush(self, req: MemoryStepRequest) -> None:
        try:
            done = tiering.flush(self, req, uuid.uuid4().hex)
        except Exception as exc:  # the step stays in memory; the trainer's next save() hears of it
            record_error("checkpoint_memory_tier")
            log.error(
                "inline flush of step %d of %r failed (the step stays in memory): %s", req.ref.step, req.ref.run, exc
            )
            aftercommit.flush_failed(self, req.ref.run, req.ref.step, f"{type(exc).__name__}: {exc}"[:2000])
            return
        replica = aftercommit.after_flush(self, req, done["storage"])
        if replica is not None:
            self._submit(self._replicate, replica)

    def _peer_copy(self, req: MemoryStepRequest) -> None:
        what = f"peer copy of step {req.ref.step} of {req.ref.run!r}"
        self._follow_up(what, lambda: tiering.peer_copy(self, req), "checkpoint_memory_tier")

    def _retain(self, req: RetentionRequest) -> None:
        self._follow_up(f"retention of {req.run!r}", lambda: aftercommit.retain(self, req), "task_failed")

    def _replicate(self, req: ReplicateRequest) -> None:
        what, task = f"replica of step {req.step} of {req.run!r}", uuid.uuid4().hex
        self._follow_up(what, lambda: replicating.replicate(self, req, task), "checkpoint_replica")

    def _follow_up(self, what: str, job: Callable[[], object], error_type: str) -> None:
        """Run a follow-up of a commit; its failure is logged and counted, the committed step stands."""
        try:
            job()
        except Exception as exc:
            record_error(error_type)
            log.error("inline %s failed (the committed step stands): %s: %s", what, type(exc).__name__, exc)

    def drain(self, timeout: float | None = None) -> None:
        """Wait (bounded by `timeout` in all) until every persist and commit sent so far, and everything that
        follows them (retention, flushes, replica and peer copies), has run; TimeoutError when it has not."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                pending = [f for f in self._futures if not f.done()]
            if not pending:
                return
            for future in pending:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                future.result(timeout=left)

    def close(self) -> None:
        """Run what was sent and what follows it to the end (a follow-up sends the next one, so the pool may
        only stop once none is pending), then stop the threads."""
        try:
            self.drain()
        finally:
            self._pool.shutdown(wait=True)
            self.redis.close()
