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

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from dcs_tasks.checkpoint.format.layout import LATEST_NAME, step_dir_name
from dcs_tasks.checkpoint.store.ledger.steps import read_latest
from dcs_tasks.storage import Location, store_of
from dcs_tasks.storage.store import Fence

LATEST_LOCK = "latest"
LATEST_LOCK_NAME = f".{LATEST_LOCK}.lock"  # its lock file in a run directory on files


def move_latest(
    run_dir: Location, step: int, tag: str, fence: Fence | None = None, first: Callable[[], None] | None = None
) -> None:
    """Point `latest` at `step` unless it already names a newer (or the same) step. `fence`: the run's lock
    where the store has none of its own (an object store: NoLock without it). `first`: a write that must be
    stored before `latest` may name the step (a commit's manifest); it runs under the lock while `latest` is
    read beside it (an object store: the GET travels with the manifest's PUT, one round trip fewer), and when
    it raises, `latest` is left as it was."""
    store = store_of(run_dir)
    with store.lock(run_dir, LATEST_LOCK, fence=fence):
        if first is None:
            current = read_latest(run_dir)
        else:
            with ThreadPoolExecutor(1, thread_name_prefix="dcs-latest") as pool:
                reading = pool.submit(read_latest, run_dir)
                first()  # raises before `latest` is touched; the pool's exit waits for the read
                current = reading.result()
        if current is not None and current >= step:
            return
        store.write_small(run_dir / LATEST_NAME, f"{step_dir_name(step)}\n".encode(), tag)
