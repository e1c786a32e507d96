"""Retention policy: which committed steps to delete, and deleting them safely.

Kept: the `keep_last` newest committed steps, every step divisible by `keep_every`, steps still in
flight, the newest step whose files are all present as regular files (not symlinks) of their manifest
sizes (the newest *good* checkpoint survives even if newer ones are damaged), and, in one rank's
directory of a multi-rank run,
the newest step every rank committed (a rank that runs ahead never deletes the only restorable step).
A step is deleted manifest-first, so a reader never sees a half-deleted step as committed.

Incremental saves (`dcs_tasks.checkpoint.store.ledger.incremental`): under the run's exclusive reference lock, a mark
phase collects every (step, file) a kept step's manifest or an in-flight step's recorded files refer to; a
deleted step that holds any of them is retired (marker, manifest removed, its other files removed) instead of
removed, and retired directories are swept again on every run, going once nothing refers to them.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

from dcs_tasks.checkpoint.format.layout import MANIFEST_NAME, RANK_DIR, STEP_DIR, step_dir_name
from dcs_tasks.checkpoint.store.ledger.incremental import RETIRED_NAME, is_retired, referenced, refs_lock
from dcs_tasks.checkpoint.store.ledger.stepledger import StepLedger
from dcs_tasks.checkpoint.store.ledger.steps import complete_steps, step_dirs
from dcs_tasks.checkpoint.store.payloads import RetentionPolicy
from dcs_tasks.checkpoint.store.reads.stepcheck import read_manifest
from dcs_tasks.errors import CorruptCheckpoint
from dcs_tasks.storage import Location, ObjectPath, store_of

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


def newest_intact(run_dir: Location) -> int | None:
    """The newest step whose manifest reads and whose files all have their recorded sizes (cheap check)."""
    for step, step_dir in reversed(step_dirs(run_dir)):
        try:
            manifest = read_manifest(step_dir)
        except CorruptCheckpoint:
            continue
        if all(regular_of_size(f.stored_path(step_dir), f.disk_size) for f in manifest.files):
            return step
    return None


def regular_of_size(path: Location, size: int) -> bool:
    """`path` is a regular file of `size` bytes, not a symlink (restore refuses those, so a step holding one
    is not intact whatever it points at); an object of `size` bytes."""
    return store_of(path).stat(path) == size


def delete_step(step_dir: Location) -> None:
    """Remove the manifest first (durably), then the rest of the directory (every object under the step)."""
    store = store_of(step_dir)
    store.delete([step_dir / MANIFEST_NAME])
    store.delete_tree(step_dir)


FileRef = tuple[int, str]  # (step holding the bytes, file name)


def retire_step(step_dir: Location, keep: set[str]) -> None:
    """Delete a step but keep the files named in `keep` (later steps use them): marker first (durably), then
    the manifest, then the other files; the whole directory when `keep` is empty. Safe to repeat after a
    crash at any point."""
    if not keep:
        delete_step(step_dir)
        return
    store = store_of(step_dir)
    if not is_retired(step_dir):
        store.write_small(step_dir / RETIRED_NAME, b"files here are used by later steps\n", "retire")
    store.delete([step_dir / MANIFEST_NAME])
    store.delete_tree(step_dir, keep=frozenset(keep | {RETIRED_NAME}))


def retired_dirs(run_dir: Location) -> dict[int, Location]:
    """Retired step directories (marker, no manifest) of `run_dir`."""
    store = store_of(run_dir)
    marked = set(store.folders_with(run_dir, RETIRED_NAME))
    manifests = set(store.folders_with(run_dir, MANIFEST_NAME))
    found: dict[int, Location] = {}
    for name in marked - manifests:
        match = STEP_DIR.match(name)
        if match and name == step_dir_name(int(match.group(1))):
            found[int(match.group(1))] = run_dir / name
    return found


def in_flight_refs(book: StepLedger, run: str) -> set[FileRef]:
    """(step, file) of every reference the ledger's in-flight steps of `run` have recorded so far."""
    refs: set[FileRef] = set()
    for step in book.in_flight_steps(run):
        for entry in book.read(run, step).files.values():
            if entry.source_step is not None:
                refs.add((entry.source_step, entry.name))
    return refs


def _marked(dirs: dict[int, Location], kept: set[int]) -> set[FileRef]:
    """Mark phase: what the kept steps' manifests refer to (an unreadable manifest cannot be restored and
    refers to nothing)."""
    refs: set[FileRef] = set()
    for step in kept:
        with contextlib.suppress(CorruptCheckpoint):
            refs |= referenced(read_manifest(dirs[step]))
    return refs


def apply_retention(
    run_dir: Location,
    policy: RetentionPolicy,
    in_flight: set[int],
    in_flight_refs: Callable[[], set[FileRef]] = set,
    object_lock: Callable[[ObjectPath], contextlib.AbstractContextManager[None]] | None = None,
) -> list[int]:
    """Delete what `policy` lets go in `run_dir`; returns the deleted steps. Files that kept steps, or the
    steps in flight (`in_flight_refs`, read under the reference lock), refer to are kept (retired steps).
    Everything runs under the run's `refs` lock (`incremental.refs_lock`, through its store): on files the run
    directory's flock, which refuses a symlink or anything but a directory (UntrustedPath: retention deletes only
    inside a real run directory); a run in an object store needs `object_lock` (its `refs` lock in Redis:
    `dcs_tasks.checkpoint.store.ledger.objlocks`; `NoLock` without one). Nothing there: nothing deleted."""
    if not store_of(run_dir).exists(run_dir):
        return []
    fence = None if object_lock is None else (lambda folder, _name: object_lock(folder))
    with refs_lock(run_dir, shared=False, fence=fence):
        return _apply(run_dir, policy, in_flight, in_flight_refs)


def _apply(
    run_dir: Location, policy: RetentionPolicy, in_flight: set[int], in_flight_refs: Callable[[], set[FileRef]]
) -> list[int]:
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
    needed = _marked(dirs, set(dirs) - set(doomed)) | in_flight_refs()
    for step in doomed:
        keep = {name for s, name in needed if s == step}
        retire_step(dirs[step], keep)
        log.info("retention: deleted %s%s", dirs[step], f" (kept {sorted(keep)}: later steps use them)" if keep else "")
    for step, step_dir in retired_dirs(run_dir).items():
        retire_step(step_dir, {name for s, name in needed if s == step})
    return doomed
