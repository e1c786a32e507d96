"""Which failures of a checkpoint task are retried, and after how long: the one policy of a `dcs worker`'s
Celery tasks (workers/taskbase.py) and of the in-process committer (`dcs_tasks.checkpoint.inline`).

OSError, ConnectionError, TimeoutError and redis connection/timeout errors (storage or Redis away for a while;
S3 errors map to `StorageUnavailable`, an OSError) are retried with exponential backoff and equal jitter
(`task.retry_delay_seconds` doubling, capped at `task.retry_backoff_max_seconds`, `dcs_tasks.backoff`), at most
`task.max_retries` times; anything else fails at once, and so do `NEVER_RETRY` errors (a malformed payload, an
untrusted path) even where they are also one of those types.
"""

from __future__ import annotations

import redis

from dcs_tasks.backoff import backoff_delay
from dcs_tasks.config import TaskSettings
from dcs_tasks.errors import InvalidTaskPayload

RETRYABLE: tuple[type[BaseException], ...] = (
    OSError,
    ConnectionError,
    TimeoutError,
    redis.ConnectionError,
    redis.TimeoutError,
)

NEVER_RETRY: tuple[type[BaseException], ...] = (InvalidTaskPayload,)


def retryable(exc: BaseException) -> bool:
    """Whether a task that raised `exc` may be tried again (retries left permitting)."""
    return isinstance(exc, RETRYABLE) and not isinstance(exc, NEVER_RETRY)


def backoff_seconds(retries: int, base: float, cap: float) -> float:
    """Exponential backoff with equal jitter: in [d/2, d] where d = min(cap, base * 2**retries)."""
    return backoff_delay(retries, base, cap, "equal")


def retry_delay(exc: BaseException, retries: int, settings: TaskSettings) -> float | None:
    """Seconds to wait before trying again a task that raised `exc` after `retries` earlier retries, or None
    when it fails for good (not retryable, or `settings.max_retries` used up)."""
    if not retryable(exc) or retries >= settings.max_retries:
        return None
    return backoff_seconds(retries, settings.retry_delay_seconds, settings.retry_backoff_max_seconds)
