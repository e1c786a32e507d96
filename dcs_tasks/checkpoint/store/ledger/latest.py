"""Moving a run's `latest` pointer: the one rule every committer follows (the worker's commit task and
`dcs ckpt import`).

`latest` only moves forward, and it moves under an exclusive `flock` on `<run>/.latest.lock`: commits of two
steps may run at once in different processes, and without the lock an older step could overwrite a newer
pointer between the read and the write. The pointer itself is written durably (temp name, fsync, rename,
directory fsync) by `fsio.write_bytes_durably`. The lock file is opened by `fsio.locked`: never through a
symlink, only a regular file (UntrustedPath otherwise).
"""

from __future__ import annotations

from pathlib import Path

from dcs_tasks.checkpoint.format.fsio import locked, write_bytes_durably
from dcs_tasks.checkpoint.format.layout import LATEST_NAME, step_dir_name
from dcs_tasks.checkpoint.store.ledger.steps import read_latest

LATEST_LOCK_NAME = ".latest.lock"


def move_latest(run_dir: Path, step: int, tag: str) -> None:
    """Point `latest` at `step` unless it already names a newer (or the same) step."""
    with locked(run_dir, LATEST_LOCK_NAME):  # never through a symlink
        current = read_latest(run_dir)
        if current is not None and current >= step:
            return
        write_bytes_durably(run_dir / LATEST_NAME, f"{step_dir_name(step)}\n".encode(), tag)
