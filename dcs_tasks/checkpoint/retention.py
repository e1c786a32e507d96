"""Retention policy: which committed steps to delete, and deleting them safely.

Kept: the `keep_last` newest committed steps, every step divisible by `keep_every`, steps still in
flight, the newest step whose files are all present as regular files (not symlinks) of their manifest
sizes (the newest *good* checkpoint survives even if newer ones are damaged), and, in one rank's
directory of a multi-rank run,
the newest step every rank committed (a rank that runs ahead never deletes the only restorable step).
A step is deleted manifest-first, so a reader never sees a half-deleted step as committed.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import stat
from pathlib import Path

from dcs_tasks.checkpoint.format import MANIFEST_NAME
from dcs_tasks.checkpoint.fsio import fsync_dir
from dcs_tasks.checkpoint.models import RetentionPolicy
from dcs_tasks.checkpoint.reader import load_manifest, step_dirs
from dcs_tasks.checkpoint.sharded import RANK_DIR, complete_steps
from dcs_tasks.errors import CorruptCheckpoint

log = logging.getLogger(__name__)


def steps_to_delete(steps: list[int], policy: RetentionPolicy, protected: set[int]) -> list[int]:
    """Pure policy: the committed `steps` (any order) that `policy` lets go, never one in `protected`."""
    if policy.keep_last is None:
        return []
    ordered = sorted(steps)
    keep = set(ordered[-policy.keep_last :]) | protected
    if policy.keep_every:
        keep |= {s for s in ordered if s % policy.keep_every == 0}
    return [s for s in ordered if s not in keep]


def newest_intact(run_dir: Path) -> int | None:
    """The newest step whose manifest reads and whose files all have their recorded sizes (cheap check)."""
    for step, step_dir in reversed(step_dirs(run_dir)):
        try:
            manifest = load_manifest(step_dir)
        except CorruptCheckpoint:
            continue
        if all(_regular_of_size(f.stored_path(step_dir), f.disk_size) for f in manifest.files):
            return step
    return None


def _regular_of_size(path: Path, size: int) -> bool:
    """`path` is a regular file of `size` bytes, not a symlink (restore refuses those, so a step holding one
    is not intact whatever it points at)."""
    try:
        found = path.lstat()
    except OSError:
        return False
    return stat.S_ISREG(found.st_mode) and found.st_size == size


def delete_step(step_dir: Path) -> None:
    """Remove the manifest first (durably), then the rest of the directory."""
    with contextlib.suppress(FileNotFoundError):
        (step_dir / MANIFEST_NAME).unlink()
        fsync_dir(step_dir)
    shutil.rmtree(step_dir, ignore_errors=True)


def apply_retention(run_dir: Path, policy: RetentionPolicy, in_flight: set[int]) -> list[int]:
    """Delete what `policy` lets go in `run_dir`; returns the deleted steps."""
    dirs = dict(step_dirs(run_dir))
    protected = set(in_flight)
    good = newest_intact(run_dir)
    if good is not None:
        protected.add(good)
    if RANK_DIR.match(run_dir.name):
        complete = complete_steps(run_dir.parent)
        if complete:
            protected.add(max(complete))
    doomed = steps_to_delete(list(dirs), policy, protected)
    for step in doomed:
        delete_step(dirs[step])
        log.info("retention: deleted %s", dirs[step])
    return doomed
