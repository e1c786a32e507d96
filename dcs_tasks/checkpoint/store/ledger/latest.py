"""Moving a run's `latest` pointer: the one rule every committer follows (the worker's commit task, replica
copies, memory-tier flushes and `dcs ckpt import`), on every store.

`latest` only moves forward, and it moves under the run's `latest` lock (`Store.lock`): commits of two steps
may run at once in different processes, and without the lock an older step could overwrite a newer pointer
between the read and the write. On files the lock is an exclusive `flock` on `<run>/.latest.lock` (never
through a symlink, only a regular file: UntrustedPath otherwise); an object store has no locks of its own, so
the caller's `fence` (the run's `latest` lock in Redis, `objlocks.run_lock`) is the lock there. The pointer
itself is written durably and atomically (`Store.write_small`: temp name, fsync, rename, directory fsync; or
one PUT).
"""

from __future__ import annotations

from dcs_tasks.checkpoint.format.layout import LATEST_NAME, step_dir_name
from dcs_tasks.checkpoint.store.ledger.steps import read_latest
from dcs_tasks.storage import Location, store_of
from dcs_tasks.storage.store import Fence

LATEST_LOCK = "latest"
LATEST_LOCK_NAME = f".{LATEST_LOCK}.lock"  # its lock file in a run directory on files


def move_latest(run_dir: Location, step: int, tag: str, fence: Fence | None = None) -> None:
    """Point `latest` at `step` unless it already names a newer (or the same) step. `fence`: the run's lock
    where the store has none of its own (an object store: NoLock without it)."""
    store = store_of(run_dir)
    with store.lock(run_dir, LATEST_LOCK, fence=fence):
        current = read_latest(run_dir)
        if current is not None and current >= step:
            return
        store.write_small(run_dir / LATEST_NAME, f"{step_dir_name(step)}\n".encode(), tag)
