"""Persist and commit in the trainer's own process: `Checkpointer(run, config, celery_app=InlineCommitter(config))`.

What a host's `dcs worker` does for a save (`dcs_tasks.checkpoint.persisting`: trust checks, ledger claims,
durable writes or uploads, incremental references, the commit, then retention), run by this process's own
threads instead of Celery tasks. Redis stays real: the ledger fences every write exactly as with workers, so a
worker and an inline committer can even serve the same run. For tests of the save path that need no worker
process, and for single-process jobs (a notebook, a CI job) that want checkpoints without running a worker;
a training fleet runs `dcs worker`: a trainer that dies takes its inline saves in flight with it (the ledger
then fails them after `abandoned_save_seconds`), while a worker's are redelivered.

`send_task` takes the calls `Checkpointer` makes (the persist task's name and JSON payload, as Celery would get
it); no retries: a persist or commit that raises fails its file or the step with the reason, as a task that
gives up does. Replicas are the worker's: an inline committer refuses to start with `replica_dir` set.
"""

from __future__ import annotations

import logging
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import redis

from dcs_tasks.celery_app import TaskName
from dcs_tasks.checkpoint import persisting
from dcs_tasks.checkpoint.store.ledger import FileOutcome, StepStatus, Verdict
from dcs_tasks.checkpoint.store.payloads import CommitRequest, PersistRequest
from dcs_tasks.checkpoint.store.retention import apply_retention, in_flight_refs
from dcs_tasks.checkpoint.trust import trusted_run_dir
from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import ConfigError
from dcs_tasks.keys import Keys
from dcs_tasks.redisconn import sync_client

log = logging.getLogger(__name__)


class InlineCommitter:
    """A stand-in for the Celery app a `Checkpointer` sends its persist tasks to, running them here."""

    inline = True  # Checkpointer: no worker presence to check

    def __init__(self, config: DCSConfig, threads: int = 2) -> None:
        if config.replica_dir is not None:
            raise ConfigError("an inline committer does not replicate: unset replica_dir or run a `dcs worker`")
        if config.memory_tier_bytes > 0:
            raise ConfigError(
                "an inline committer has no memory tier (flushes and peer copies run in `dcs worker`): "
                "set memory_tier_bytes=0 or run a `dcs worker`"
            )
        self.config = config
        self.keys = Keys(config.namespace)
        self.redis: redis.Redis = sync_client(config)
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="dcs-inline")
        self._futures: list[Future[None]] = []

    def send_task(self, name: str, args: list[Any] | None = None, **_: Any) -> None:
        if name != TaskName.PERSIST.value or not args:
            raise ValueError(f"an inline committer runs persist tasks only, not {name!r}")
        payload = args[0]
        self._futures = [f for f in self._futures if not f.done()]
        self._futures.append(self._pool.submit(self._persist, payload, uuid.uuid4().hex))

    def _persist(self, payload: dict[str, Any], task_id: str) -> None:
        req = PersistRequest.model_validate(payload)
        try:
            verdict = persisting.persist(self, req, task_id)
        except Exception as exc:
            log.warning("inline persist of %s step %d failed: %s", req.file_name, req.ref.step, exc)
            reason = f"persisting {req.file_name} failed: {type(exc).__name__}: {exc}"
            persisting.finish(self, req, FileOutcome.FAILED, reason[:2000])
            return
        if verdict is Verdict.COMMIT:
            self._commit(CommitRequest(ref=req.ref, retention=req.retention), uuid.uuid4().hex)

    def _commit(self, req: CommitRequest, task_id: str) -> None:
        ref = req.ref
        try:
            verdict = persisting.commit(self, req, task_id)
        except Exception as exc:
            log.warning("inline commit of %s step %d failed: %s", ref.run, ref.step, exc)
            reason = f"commit failed: {type(exc).__name__}: {exc}"[:2000]
            persisting.ledger(self).finish_commit(
                ref.run, ref.step, ref.token, StepStatus.FAILED, reason, task_id=task_id
            )
            persisting.remove_partial_step_at(self, ref.step_dir, ref.run, ref.step)
            return
        if verdict is Verdict.WRITE and req.retention.active:
            try:
                run_dir = trusted_run_dir(ref.step_dir.rpartition("/")[0], ref.run, self.config)
                book = persisting.ledger(self)
                apply_retention(
                    run_dir,
                    req.retention,
                    book.in_flight_steps(ref.run),
                    lambda: in_flight_refs(book, ref.run),
                    object_lock=lambda where: persisting.object_lock(self)(where, "refs"),
                )
            except Exception as exc:  # the step is committed; retention runs again after the next one
                log.warning("inline retention of %s failed: %s", ref.run, exc)

    def drain(self, timeout: float | None = None) -> None:
        """Wait (bounded) until every persist and commit sent so far has run."""
        for future in list(self._futures):
            future.result(timeout=timeout)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.redis.close()
