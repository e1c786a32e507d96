"""Restore's one planner: which step, which copy of it, and how rank r of W reads it.

Steps (`find_steps`). A run's steps are looked for under each of its roots in order (the memory tier, the
primary, the replica: `Checkpointer._roots`). A run saved by one trainer (the plain layout) and read by one
trainer lists every committed step of each root; otherwise only the steps every saving rank committed count
(`sharded.scan_steps`), and a step one of whose ranks' manifests is corrupt in a root is a corrupt copy there.
`RunSteps.choose` takes the asked step, or the newest whose load succeeds, falling back to older ones with a
warning; `RunSteps.copies` names the copies of one step in root order, each opened into a `StepShards` (the
manifests read with `reader.load_manifest`). Trying the copies in turn is the caller's (`replicas`).

Reads (`plan`, then `read`). Every kind of restore goes through one `RestorePlan` over the opened step:
- WHOLE: a plain step read by one trainer, no DTensors, `strict`: every file read once (`reader.load_tensors`:
  fileread, or objread's scatter reads on an object store), straight into `into=`'s tensors when given;
- RESHARD: `sharding=` states read by another rank or world size: whole files of only the source ranks whose
  parts overlap this rank's (`sharded.plan_reshard`), cut and joined (`sharded.assemble`: no copy when a part
  is one whole source shard), then copied into `into=` after the names, shapes and dtypes are checked;
- RANGES: DTensors in the step or in `into`, or `strict=False`: only the byte ranges the targets need
  (`boxread.restore_step`, chunk-verified range reads).
Where a `sharding=` tensor is cut for a rank is `sharded.SplitTensor.part` in both RESHARD and RANGES.
When `into=` holds device (CUDA) tensors, every kind is carried out by `device.py` instead (page-locked ring
slots, side-stream copies, one synchronisation); CPU targets never take that path.
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, TypeVar

from dcs_tasks.checkpoint.format.layout import Manifest
from dcs_tasks.checkpoint.restore import boxread, reader, sharded
from dcs_tasks.checkpoint.restore.lend import Unmappable
from dcs_tasks.checkpoint.state.structure import flatten_state, unflatten_state
from dcs_tasks.checkpoint.store.ledger.steps import StepShards
from dcs_tasks.checkpoint.store.reads.stepcheck import check_files
from dcs_tasks.checkpoint.store.tiers.seal import read_seals
from dcs_tasks.errors import CheckpointNotFound, CorruptCheckpoint
from dcs_tasks.storage import Location, store_of

if TYPE_CHECKING:
    from dcs_tasks.checkpoint.restore.device import DeviceRestorer

R = TypeVar("R")
Opener = Callable[[], StepShards]
StepCopy = tuple[str, Location, Opener]  # (location, path read: a step directory, or multi-rank its run root)


class Kind(Enum):
    WHOLE = "whole"
    RESHARD = "reshard"
    RANGES = "ranges"


@dataclass(frozen=True)
class RestorePlan:
    """How rank `rank` of `world_size` reads one opened step (see the module doc for the kinds)."""

    shards: StepShards
    kind: Kind
    rank: int
    world_size: int
    local: int  # the source rank whose structure, metadata and rank-local tensors this rank takes
    into: Any
    strict: bool
    reshard: sharded.ReshardPlan | None = None  # RESHARD: the source ranks and slices to read


@dataclass(frozen=True)
class Loaded:
    """What `read` produced: the step, its state (the checkpoint's structure over the tensors read, or `into`
    itself when not `strict`), its user metadata, the data bytes read and the seconds the read took."""

    step: int
    state: Any
    metadata: dict[str, Any]
    nbytes: int
    seconds: float


def has_dtensors(shards: StepShards, into: Any) -> bool:
    """Whether the step holds DTensor shards or the target holds DTensors (the byte-range restore path)."""
    if any(m.dtensors for m in shards.manifests.values()):
        return True
    return into is not None and bool(flatten_state(into).dtensors)


def plan(shards: StepShards, rank: int, world_size: int, into: Any = None, strict: bool = True) -> RestorePlan:
    """The one plan for every restore of `shards` by rank `rank` of `world_size`. Raises CorruptCheckpoint
    (RESHARD) when the ranks' manifests disagree on a `sharding=` tensor."""
    local = sharded.local_source(shards, rank)
    if not strict or has_dtensors(shards, into):
        return RestorePlan(shards, Kind.RANGES, rank, world_size, local, into, strict)
    if shards.world_size == 1 and world_size == 1:
        return RestorePlan(shards, Kind.WHOLE, rank, world_size, local, into, strict)
    reshard = sharded.plan_reshard(shards, rank, world_size)
    return RestorePlan(shards, Kind.RESHARD, rank, world_size, local, into, strict, reshard)


def read(
    p: RestorePlan,
    verify: bool = True,
    source: reader.Source = reader.Source.STORAGE,
    device: DeviceRestorer | None = None,
) -> Loaded:
    """Carry out `p`. `source`: which copy is read, and so how (`reader.Source`: a step in this host's memory
    tier is lent or copied from a mapping, its sealed files not hashed again). When `into` holds device (CUDA)
    tensors every kind goes through `device` (`restore.device`: page-locked chunks on a side stream). Raises
    CorruptCheckpoint (a file or chunk fails its checks), StateMismatch (`into` does not fit; checked before
    anything is read into it)."""
    started = time.perf_counter()
    if device is not None and device.wants(p.into):
        return _read_to_device(p, verify, source, device, started)
    shards, manifest = p.shards, p.shards.manifests[p.local]
    if p.kind is Kind.RANGES:
        state, nbytes = boxread.restore_step(shards, p.rank, p.world_size, p.into, verify, p.strict)
    else:
        targets = flatten_state(p.into).tensors if p.into is not None else None
        if p.kind is Kind.WHOLE:
            if targets is not None:
                reader.check_targets(manifest, targets)
            tensors = reader.load_tensors(shards.dirs[p.local], manifest, verify=verify, into=targets, source=source)
            nbytes = manifest.total_bytes
        else:
            assert p.reshard is not None
            loaded = {
                src: reader.load_tensors(shards.dirs[src], shards.manifests[src], verify=verify, source=source)
                for src in p.reshard.sources
            }
            tensors = sharded.assemble(p.reshard, shards, loaded)
            if targets is not None:
                tensors = sharded.fill(targets, tensors)
            nbytes = sum(shards.manifests[src].total_bytes for src in p.reshard.sources)
        state = unflatten_state(manifest.structure, tensors)
    return Loaded(shards.step, state, dict(manifest.metadata), nbytes, time.perf_counter() - started)


def _read_to_device(
    p: RestorePlan, verify: bool, source: reader.Source, device: DeviceRestorer, started: float
) -> Loaded:
    """`read` for an `into` holding device tensors: one uploader (ring and side streams) for every kind."""
    from dcs_tasks.checkpoint.restore.device import load_mapped, load_whole, put_all

    shards, manifest = p.shards, p.shards.manifests[p.local]
    uploader = device.uploader()
    if p.kind is Kind.RANGES:
        try:
            state, nbytes = boxread.restore_step(shards, p.rank, p.world_size, p.into, verify, p.strict, uploader.put)
        finally:
            uploader.finish()
        return Loaded(shards.step, state, dict(manifest.metadata), nbytes, time.perf_counter() - started)
    targets = flatten_state(p.into).tensors
    if p.kind is Kind.WHOLE:
        reader.check_targets(manifest, targets)
        step_dir = shards.dirs[p.local]
        check_files(step_dir, manifest)
        local = store_of(step_dir).local_path(step_dir) if source is not reader.Source.STORAGE else None
        seals = read_seals(local) if source is reader.Source.SEALED and local is not None else {}
        try:
            if local is None:
                raise Unmappable("not a memory-tier step")
            load_mapped(local, manifest, targets, verify, seals, uploader)
        except Unmappable:
            load_whole(step_dir, manifest, targets, verify, uploader)
        nbytes = manifest.total_bytes
    else:
        assert p.reshard is not None
        loaded = {
            src: reader.load_tensors(shards.dirs[src], shards.manifests[src], verify=verify, source=source)
            for src in p.reshard.sources
        }
        tensors = sharded.assemble(p.reshard, shards, loaded)
        shapes = {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}
        reader.check_targets(shapes, targets, note=" (resharded for this rank)")
        put_all(uploader, targets, tensors)
        nbytes = sum(shards.manifests[src].total_bytes for src in p.reshard.sources)
    state = unflatten_state(manifest.structure, dict(targets))
    return Loaded(shards.step, state, dict(manifest.metadata), nbytes, time.perf_counter() - started)


# --- which step -------------------------------------------------------------------------------------------


def _open_plain(step_dir: Location) -> StepShards:
    manifest = reader.load_manifest(step_dir)
    return StepShards(manifest.step, 1, {0: step_dir}, {0: manifest})


def _opened(shards: StepShards) -> StepShards:
    return shards


def _raise(exc: CorruptCheckpoint) -> StepShards:
    raise exc


@dataclass(frozen=True)
class RunSteps:
    """The committed steps of one run under its roots, as restore sees them (`find_steps`)."""

    run: str
    run_root: Location  # the primary run directory (named in errors)
    plain: bool  # one trainer reading a run saved by one trainer: every committed step counts
    copies_of: dict[int, list[StepCopy]]

    @property
    def steps(self) -> list[int]:
        return sorted(self.copies_of)

    def copies(self, step: int) -> list[StepCopy]:
        """The copies of `step`, in root order (none when no root holds it)."""
        return list(self.copies_of.get(step, []))

    def choose(self, step: int | None, load: Callable[[int], R], stacklevel: int = 3) -> R:
        """`load(step)`; without `step`, `load` the newest step, falling back to older ones on CorruptCheckpoint
        (a RuntimeWarning at `stacklevel`, by default the caller's caller: restore's). Raises CheckpointNotFound
        when `step` is not committed, or no step loads."""
        if step is not None:
            if step not in self.copies_of:
                raise CheckpointNotFound(self._missing(step))
            return load(step)
        for candidate in reversed(self.steps):
            try:
                return load(candidate)
            except CorruptCheckpoint as exc:
                warnings.warn(
                    f"checkpoint step {candidate} is corrupt ({exc}); falling back to an older one",
                    RuntimeWarning,
                    stacklevel=stacklevel,
                )
        what = "committed checkpoint" if self.plain else "step every rank committed"
        raise CheckpointNotFound(f"run {self.run!r} has no {what} in {self.run_root} that verifies")

    def _missing(self, step: int) -> str:
        if self.plain:
            return f"run {self.run!r} has no committed step {step} in {self.run_root}"
        partial = sharded.incomplete_steps(self.run_root).get(step)
        detail = f"only ranks {partial} committed it" if partial else "no rank committed it"
        return f"run {self.run!r} has no complete step {step} ({detail}) in {self.run_root}"


def find_steps(run: str, roots: Sequence[tuple[str, Location]], run_root: Location, world_size: int) -> RunSteps:
    """The steps of `run` under `roots` ((location, run directory), read first to last) for a restore at
    `world_size`; `run_root` is the primary run directory, named in errors."""
    copies: dict[int, list[StepCopy]] = {}
    plain = world_size == 1 and not any(sharded.rank_dirs(root) for _, root in roots)
    for location, root in roots:
        if plain:
            for s, step_dir in reader.step_dirs(root):
                copies.setdefault(s, []).append((location, step_dir, functools.partial(_open_plain, step_dir)))
            continue
        complete, broken = sharded.scan_steps(root)
        for s in complete.keys() | broken.keys():
            # a rank's manifest of this step is corrupt in this location: a corrupt copy
            opener = functools.partial(_raise, broken[s]) if s in broken else functools.partial(_opened, complete[s])
            copies.setdefault(s, []).append((location, root, opener))
    return RunSteps(run, run_root, plain, copies)


def committed_manifests(
    run_dirs: Iterable[Location], on_corrupt: Callable[[CorruptCheckpoint], None]
) -> dict[int, tuple[Manifest, Location]]:
    """step -> (manifest, step directory) of the committed steps under `run_dirs`, the first directory holding a
    step winning; an unreadable manifest is passed to `on_corrupt` and skipped."""
    found: dict[int, tuple[Manifest, Location]] = {}
    for run_dir in run_dirs:
        for step, step_dir in reader.step_dirs(run_dir):
            if step in found:
                continue
            try:
                found[step] = (reader.load_manifest(step_dir), step_dir)
            except CorruptCheckpoint as exc:
                on_corrupt(exc)
    return found
