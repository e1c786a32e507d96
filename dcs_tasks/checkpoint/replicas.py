"""Where a run's steps are: the primary root (`checkpoint_dir`) and, when set, the replica root (`replica_dir`).

A replica is the same relative tree under the other root, written by the worker's replicate task
(`dcs_tasks.checkpoint.replicating`). Readers pick a step's copy in one order: the newest step that verifies in either
location wins; for that step the primary copy is tried first and the replica when the primary is missing or
corrupt (the restore result, a warning and the log name the copy used). A step never mixes copies: all of a
multi-rank step's parts come from one location.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Callable, Sequence

from dcs_tasks import storage
from dcs_tasks.checkpoint.pending import RestoredCheckpoint
from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import CorruptCheckpoint
from dcs_tasks.storage import Location, store_of

log = logging.getLogger(__name__)

PRIMARY = "primary"
REPLICA = "replica"
BOTH = "both"
MEMORY = "memory"  # the memory tier (dcs_tasks.checkpoint.store.tiers.MEMORY)


def run_roots(config: DCSConfig, run: str) -> list[tuple[str, Location]]:
    """(location, run directory) for the primary root and, when `replica_dir` is set, the replica root (each a
    directory or an object-store prefix: `dcs_tasks.storage`)."""
    roots: list[tuple[str, Location]] = [(PRIMARY, (storage.root(config.checkpoint.dir, config) / run).resolve())]
    if config.checkpoint.replica_dir is not None:
        roots.append((REPLICA, (storage.root(config.checkpoint.replica_dir, config) / run).resolve()))
    return roots


def where(locations: Sequence[str]) -> str:
    """ "primary", "replica" or "both" for the locations holding a step."""
    found = set(locations)
    return BOTH if found >= {PRIMARY, REPLICA} else (REPLICA if REPLICA in found else PRIMARY)


Copy = tuple[str, Location, Callable[[], RestoredCheckpoint]]  # (location, path, load it)


def load_first_good(step: int, copies: Sequence[Copy], heal: bool = False) -> RestoredCheckpoint:
    """Load the first of `copies` (primary first) that verifies, stamped with its location and path. A
    corrupt copy followed by another warns naming both; when none verifies the first error is raised. `heal`
    (a verified restore): the primary's file named by its error is rewritten from the copy that verified
    (`heal_from`), so the steps that share that file are whole again."""
    first: CorruptCheckpoint | None = None
    for index, (location, path, load) in enumerate(copies):
        try:
            restored = load()
        except CorruptCheckpoint as exc:
            first = first or exc
            if index + 1 < len(copies):
                nxt = copies[index + 1][0]
                message = f"{location} copy of step {step} is corrupt ({exc}); trying the {nxt} copy"
                log.warning(message)
                warnings.warn(message, RuntimeWarning, stacklevel=5)
            continue
        if location not in (PRIMARY, MEMORY):  # the memory tier is read first by design
            log.warning("restored step %d from the %s at %s", step, location, path)
            if heal and first is not None and copies[0][0] == PRIMARY:
                heal_from(first, copies[0][1], path)
        return dataclasses.replace(restored, location=location, path=path)
    assert first is not None, "load_first_good needs at least one copy"
    raise first


def heal_from(error: CorruptCheckpoint, primary_step: Location, good_step: Location) -> bool:
    """Rewrite the primary file `error` names (under the primary run) with the same file of the copy that just
    verified (`good_step`'s run): complete bytes under a temp name then a rename on files, one upload on an
    object store. Returns whether it healed; a failure is logged and changes nothing."""
    from dcs_tasks.checkpoint.format.validate import MAX_MANIFEST_BYTES
    from dcs_tasks.checkpoint.store.reads.stepcheck import read_small

    primary_run, good_run = primary_step.parent, good_step.parent
    named = error.path or ""
    prefix = str(primary_run) + "/"
    if not named.startswith(prefix):
        return False
    parts = named[len(prefix) :].split("/")
    if len(parts) != 2 or parts[1].startswith("."):
        return False
    source, target = good_run / parts[0] / parts[1], primary_run / parts[0] / parts[1]
    try:
        data = read_small(source, MAX_MANIFEST_BYTES)  # a file the restore just verified (bounded: one shard)
        store_of(target).write_small(target, data, "heal")
    except Exception as exc:  # healing is a bonus: the restore itself succeeded
        log.warning("could not heal %s from %s: %s: %s", target, source, type(exc).__name__, exc)
        return False
    log.warning("healed %s from the verified copy %s", target, source)
    return True
