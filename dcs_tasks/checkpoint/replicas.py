"""Where a run's steps are: the primary root (`checkpoint_dir`) and, when set, the replica root (`replica_dir`).

A replica is the same relative tree under the other root, written by the worker's replicate task
(`workers/replica.py`). Readers pick a step's copy in one order: the newest step that verifies in either
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
from dcs_tasks.storage import Location

log = logging.getLogger(__name__)

PRIMARY = "primary"
REPLICA = "replica"
BOTH = "both"


def run_roots(config: DCSConfig, run: str) -> list[tuple[str, Location]]:
    """(location, run directory) for the primary root and, when `replica_dir` is set, the replica root (each a
    directory or an object-store prefix: `dcs_tasks.storage`)."""
    roots: list[tuple[str, Location]] = [(PRIMARY, (storage.root(config.checkpoint_dir, config) / run).resolve())]
    if config.replica_dir is not None:
        roots.append((REPLICA, (storage.root(config.replica_dir, config) / run).resolve()))
    return roots


def where(locations: Sequence[str]) -> str:
    """ "primary", "replica" or "both" for the locations holding a step."""
    found = set(locations)
    return BOTH if found >= {PRIMARY, REPLICA} else (REPLICA if REPLICA in found else PRIMARY)


Copy = tuple[str, Location, Callable[[], RestoredCheckpoint]]  # (location, path, load it)


def load_first_good(step: int, copies: Sequence[Copy]) -> RestoredCheckpoint:
    """Load the first of `copies` (primary first) that verifies, stamped with its location and path. A
    corrupt copy followed by another warns naming both; when none verifies the first error is raised."""
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
        if location != PRIMARY:
            log.warning("restored step %d from the %s at %s", step, location, path)
        return dataclasses.replace(restored, location=location, path=path)
    assert first is not None, "load_first_good needs at least one copy"
    raise first
