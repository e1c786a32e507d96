"""`DCSTask`: the Celery task base class with the reliability rules of docs/reliability.md.

- Redelivery cap: acks_late + reject_on_worker_lost redeliver a task whose process died (kill -9, OOM).
  Each start increments a Redis counter per (task id, retry number); past `config.task.max_redeliveries`
  the task fails with `RedeliveryLimitExceeded` instead of looping.
- Retries: the policy of `dcs_tasks.retrypolicy` (shared with the in-process committer): OSError,
  ConnectionError, TimeoutError (and redis connection/timeout errors) are retried with exponential backoff and
  jitter (`retry_delay_seconds` doubling, capped at `retry_backoff_max_seconds`, at most `max_retries` times);
  validation and other errors fail at once. `NEVER_RETRY` errors (a payload that is malformed or names an
  untrusted path) fail at once even where they are also one of those types.
- `give_up(payload, reason)`: subclasses record a final failure (called once the task fails for good,
  whatever the cause), e.g. mark the checkpoint FAILED so a waiting trainer gets the reason.
- Metrics: `dcs_errors_total{error_type="task_retry"}` per retry scheduled, `{error_type="task_failed"}` per
  task failed for good unless its class overrides `give_up` (those record their own, more precise type,
  e.g. `checkpoint_persist`), so no failure is counted twice.
"""

from __future__ import annotations

import logging
from typing import Any, TypeVar

from celery import Task
from pydantic import BaseModel, ValidationError

from dcs_tasks.errors import DCSError, InvalidTaskPayload
from dcs_tasks.metrics import get_metrics
from dcs_tasks.retrypolicy import NEVER_RETRY, RETRYABLE, retry_delay
from dcs_tasks.retrypolicy import backoff_seconds as backoff_seconds  # for callers of the task base
from workers.runtime import runtime

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)
RETRY_ERROR = "task_retry"
FAILED_ERROR = "task_failed"


class RedeliveryLimitExceeded(DCSError):
    """A task was delivered more often than `max_redeliveries` (its process kept dying)."""


def parse_payload(model: type[M], payload: Any, task: str) -> M:
    """`payload` as `model`, or InvalidTaskPayload naming each bad field (never the raw input): a malformed
    payload fails at once and is never retried."""
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'payload'}: {e['msg']}" for e in exc.errors())
        raise InvalidTaskPayload(f"{task} payload refused: {problems[:2000]}") from None


class DCSTask(Task):
    """Base class for DCS tasks (use `shared_task(base=DCSTask, bind=True, ...)`)."""

    abstract = True
    acks_late = True
    reject_on_worker_lost = True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            self._count_delivery()
            return super().__call__(*args, **kwargs)
        except NEVER_RETRY:
            raise
        except RETRYABLE as exc:
            config = runtime().config
            countdown = None if self.request.called_directly else retry_delay(exc, self.request.retries, config.task)
            if countdown is None:
                raise
            log.warning(
                "%s[%s] retry %d in %.2fs: %s", self.name, self.request.id, self.request.retries + 1, countdown, exc
            )
            get_metrics().record_error(RETRY_ERROR)
            raise self.retry(exc=exc, countdown=countdown, max_retries=config.task.max_retries) from exc

    def _count_delivery(self) -> None:
        if self.request.called_directly or not self.request.id:
            return
        rt = runtime()
        key = rt.keys.task_deliveries(f"{self.request.id}:{self.request.retries}")
        pipe = rt.redis.pipeline()
        pipe.incr(key)
        pipe.expire(key, int(rt.config.task.visibility_timeout_seconds * 2))
        count = int(pipe.execute()[0])
        if count > rt.config.task.max_redeliveries:
            raise RedeliveryLimitExceeded(
                f"task {self.name}[{self.request.id}] was delivered {count} times (cap "
                f"{rt.config.task.max_redeliveries}): its worker process keeps dying while running it"
            )

    def on_failure(self, exc: BaseException, task_id: str, args: Any, kwargs: Any, einfo: Any) -> None:
        reason = f"{type(exc).__name__}: {exc}"
        log.error("%s[%s] failed for good: %s", self.name, task_id, reason)
        if type(self).give_up is DCSTask.give_up:
            get_metrics().record_error(FAILED_ERROR)
        try:
            self.give_up(args, kwargs, reason)
        except Exception:
            log.exception("%s[%s]: could not record the failure", self.name, task_id)

    def give_up(self, args: Any, kwargs: Any, reason: str) -> None:
        """Record a final failure. Subclasses override; the default only logs."""
