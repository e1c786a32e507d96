"""The committed steps of a run as its store holds them, read without torch: the step directories
(`step_dirs`), the `latest` pointer (`read_latest`), the rank directories of a multi-rank run (`rank_dirs`)
and the steps every rank committed (`scan_steps`, `complete_steps`, `incomplete_steps`).

Manifests are read with `stepcheck.read_manifest` (every check of the format stage) unless the caller passes
its own `load`: restore passes `reader.load_manifest`, which also decodes the structure against torch.
Retention, incremental saves and the `latest` pointer use this module as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import overload

from dcs_tasks.checkpoint.format.layout import LATEST_NAME, MANIFEST_NAME, RANK_DIR, STEP_DIR, Manifest, step_dir_name
from dcs_tasks.checkpoint.store.reads.stepcheck import read_manifest, read_small
from dcs_tasks.errors import CorruptCheckpoint, StorageError
from dcs_tasks.storage import Location, ObjectPath, store_of

Load = Callable[[Location], Manifest]  # one step directory -> its manifest, checked (CorruptCheckpoint)


@overload
def step_dirs(run_dir: Path) -> list[tuple[int, Path]]: ...
@overload
def step_dirs(run_dir: ObjectPath) -> list[tuple[int, ObjectPath]]: ...
@overload
def step_dirs(run_dir: Location) -> list[tuple[int, Location]]: ...
def step_dirs(run_dir: Location) -> list[tuple[int, Location]] | list[tuple[int, Path]] | list[tuple[int, ObjectPath]]:
    """(step, directory) of every step directory holding a manifest, oldest first. Only real directories
    named exactly as DCS names them count (no symlinks, no `step-+5` alias of `step-000000005`). In an object
    store: every `<run>/step-N/manifest.json` object (one listing)."""
    found = []
    for name in store_of(run_dir).folders_with(run_dir, MANIFEST_NAME):
        match = STEP_DIR.match(name)
        if match and name == step_dir_name(int(match.group(1))):
            found.append((int(match.group(1)), run_dir / name))
    return sorted(found, key=lambda pair: pair[0])


def read_latest(run_dir: Location) -> int | None:
    """The step named by the `latest` pointer, or None (also when it is a symlink or not a short file)."""
    try:
        text = read_small(run_dir / LATEST_NAME, 64).decode("ascii").strip().removeprefix("step-")
    except (CorruptCheckpoint, OSError, ValueError, StorageError):
        return None
    return int(text) if text.isdigit() else None


def rank_dirs(run_root: Location) -> dict[int, Location]:
    """rank -> its directory, for a multi-rank run (empty for a plain single-rank run). Symlinks do not count."""
    return {
        int(m.group(1)): run_root / name
        for name in store_of(run_root).names(run_root)  # no symlinks
        if (m := RANK_DIR.fullmatch(name)) is not None
    }


@dataclass(frozen=True)
class StepShards:
    """One complete step: every rank's step directory and manifest."""

    step: int
    world_size: int
    dirs: dict[int, Location]
    manifests: dict[int, Manifest]


def complete_steps(run_root: Location, load: Load = read_manifest) -> dict[int, StepShards]:
    """step -> its shards, for every step that all ranks of its world size committed (plain runs: every
    committed step, as world size 1). Unreadable manifests count as not committed."""
    return scan_steps(run_root, load)[0]


def scan_steps(
    run_root: Location, load: Load = read_manifest
) -> tuple[dict[int, StepShards], dict[int, CorruptCheckpoint]]:
    """(complete steps, steps some rank's manifest of which is corrupt: the first such error). `load` reads
    and checks one step's manifest (restore passes `reader.load_manifest`, which also decodes the structure
    against torch). A step some rank below rank 0's world size never committed is skipped quietly (a crash
    between the ranks' commits); a manifest naming another rank than its directory's, or a rank below that
    world size naming another world size, makes the step corrupt (reported, so restore warns as it falls
    back). Ranks at or past rank 0's world size are leftovers of a run saved at another size and ignored."""
    ranks = rank_dirs(run_root)
    if not ranks:
        ranks = {0: run_root}
    found: dict[int, dict[int, tuple[Location, Manifest]]] = {}
    broken: dict[int, CorruptCheckpoint] = {}
    for rank, directory in sorted(ranks.items()):
        for step, step_dir in step_dirs(directory):
            try:
                manifest = load(step_dir)
            except CorruptCheckpoint as exc:
                broken.setdefault(step, exc)
                continue
            if manifest.rank != rank:
                broken.setdefault(step, CorruptCheckpoint(f"{step_dir}: the manifest names rank {manifest.rank}"))
                continue
            found.setdefault(step, {})[rank] = (step_dir, manifest)
    out = {}
    for step, shards in sorted(found.items()):
        if step in broken or 0 not in shards:
            continue
        world = shards[0][1].world_size  # rank 0's; a rank at or past it is a leftover of another world size
        shards = {r: got for r, got in shards.items() if r < world}
        other = {r: m.world_size for r, (_, m) in shards.items() if m.world_size != world}
        if other:
            said = ", ".join(f"rank {r} says {w}" for r, w in sorted(other.items()))
            broken[step] = CorruptCheckpoint(f"step {step}: rank 0's manifest says world size {world}, {said}")
            continue
        if set(shards) != set(range(world)):
            continue
        out[step] = StepShards(
            step, world, {r: d for r, (d, _) in shards.items()}, {r: m for r, (_, m) in shards.items()}
        )
    return out, broken


def incomplete_steps(run_root: Location, load: Load = read_manifest) -> dict[int, list[int]]:
    """step -> ranks that committed it, for steps not every rank committed (for error messages)."""
    ranks = rank_dirs(run_root)
    seen: dict[int, list[int]] = {}
    for rank, directory in sorted(ranks.items()):
        for step, _ in step_dirs(directory):
            seen.setdefault(step, []).append(rank)
    complete = complete_steps(run_root, load)
    return {step: got for step, got in seen.items() if step not in complete}
