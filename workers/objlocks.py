"""Locks of runs kept in an object store, held in Redis (an object store has no `flock`).

One lock per run location and purpose, with a bounded wait and a lease: a worker killed while it holds one
blocks others for at most the lease (`LEASE_SECONDS`), never for good.
- `latest`: the commit's read-compare-write of the run's `latest` object (it only moves forward);
- `refs`: a persist choosing an earlier step's file to refer to until the reference is recorded, against
  retention deleting steps (the file-system side holds `.refs.lock` shared/exclusive for the same).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import redis
from redis.exceptions import LockError

from dcs_tasks.errors import CheckpointFailed
from dcs_tasks.storage import ObjectPath
from workers.runtime import runtime

WAIT_SECONDS = 30.0
LEASE_SECONDS = 120.0


@contextlib.contextmanager
def run_lock(run_dir: ObjectPath, purpose: str) -> Iterator[None]:
    rt = runtime()
    lock = rt.redis.lock(
        rt.keys.object_run_lock(purpose, str(run_dir)), timeout=LEASE_SECONDS, blocking_timeout=WAIT_SECONDS
    )
    if not lock.acquire():
        raise CheckpointFailed(f"could not take the {purpose} lock of {run_dir} within {WAIT_SECONDS:g} s")
    try:
        yield
    finally:
        with contextlib.suppress(redis.RedisError, LockError):
            lock.release()
