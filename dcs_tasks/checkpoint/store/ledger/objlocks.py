"""Locks of runs kept in an object store, held in Redis (an object store has no `flock`).

One lock per run location and purpose, with a bounded wait and a lease: a process killed while it holds one
blocks others for at most the lease (`LEASE_SECONDS`), never for good.
- `latest`: a commit's read-compare-write of the run's `latest` object (it only moves forward);
- `refs`: a persist choosing an earlier step's file to refer to, until the reference is recorded, against
  retention (the worker's task and `dcs ckpt gc`) deleting steps. The file-system side holds `<run>/.refs.lock`
  shared/exclusive for the same; here both sides take it exclusively (each holds it for milliseconds).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import redis
from redis.exceptions import LockError

from dcs_tasks.errors import CheckpointFailed
from dcs_tasks.keys import Keys
from dcs_tasks.storage import ObjectPath

WAIT_SECONDS = 30.0
LEASE_SECONDS = 120.0


@contextlib.contextmanager
def run_lock(client: redis.Redis, keys: Keys, run_dir: ObjectPath, purpose: str) -> Iterator[None]:
    lock = client.lock(
        keys.object_run_lock(purpose, str(run_dir)), timeout=LEASE_SECONDS, blocking_timeout=WAIT_SECONDS
    )
    if not lock.acquire():
        raise CheckpointFailed(f"could not take the {purpose} lock of {run_dir} within {WAIT_SECONDS:g} s")
    try:
        yield
    finally:
        with contextlib.suppress(redis.RedisError, LockError):
            lock.release()
