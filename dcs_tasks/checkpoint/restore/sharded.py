"""Multi-rank checkpoints: where each rank's shard lives, which steps every rank committed, and resharding.

A run saved by `world_size` > 1 trainers keeps one sub-directory per rank,
`<checkpoint_dir>/<run>/rank-00003/step-00000040/`, each an ordinary single-rank checkpoint (own files,
own `manifest.json`, own `latest`, own ledger entry under `<run>.rank-00003`). A step exists for readers
only when every rank 0..world_size-1 committed it with the same world size (*complete*); a step that some
rank never committed is ignored, so a crash between ranks' commits can never be restored half-way. A run
saved by a single trainer (the plain layout, `<run>/step-.../`) reads as a complete 1-rank run.

Resharding. `save(..., sharding={"model/w": 0})` marks flat tensor names (see `flatten_state`: keys joined
by "/") as split along a dimension across ranks, in rank order; shards may be uneven. Every other tensor is
rank-local (replicated tensors of data-parallel training are simply equal on every rank). Restoring as rank
r of W':
- a sharded tensor is the global tensor (the ranks' shards concatenated along its dim) split like
  `torch.tensor_split(global, W', dim)[r]`, read only from the source ranks that overlap that part;
- rank-local tensors and the non-tensor structure come from source rank r, or rank 0 when r >= W.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dcs_tasks.checkpoint.format.layout import RANK_DIR as RANK_DIR
from dcs_tasks.checkpoint.format.layout import rank_dir_name as rank_dir_name
from dcs_tasks.checkpoint.format.layout import shard_run_name as shard_run_name
from dcs_tasks.checkpoint.restore.reader import check_targets, load_manifest
from dcs_tasks.checkpoint.store.ledger import steps
from dcs_tasks.checkpoint.store.ledger.steps import StepShards as StepShards
from dcs_tasks.checkpoint.store.ledger.steps import rank_dirs as rank_dirs
from dcs_tasks.errors import CheckpointError, CorruptCheckpoint
from dcs_tasks.storage import Location

if TYPE_CHECKING:  # imported by the functions that make tensors; listing a run's steps (retention) needs none
    import torch


def scan_steps(run_root: Location) -> tuple[dict[int, StepShards], dict[int, CorruptCheckpoint]]:
    """`steps.scan_steps` as restore sees it: each manifest read with `reader.load_manifest`."""
    return steps.scan_steps(run_root, load_manifest)


def complete_steps(run_root: Location) -> dict[int, StepShards]:
    """`steps.complete_steps` as restore sees it: each manifest read with `reader.load_manifest`."""
    return steps.complete_steps(run_root, load_manifest)


def incomplete_steps(run_root: Location) -> dict[int, list[int]]:
    """`steps.incomplete_steps` as restore sees it: each manifest read with `reader.load_manifest`."""
    return steps.incomplete_steps(run_root, load_manifest)


def check_sharding(sharding: Mapping[str, int], tensors: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """Validate `save(sharding=...)` against the flat tensors; CheckpointError names the first bad entry."""
    out = {}
    for name, dim in sharding.items():
        tensor = tensors.get(name)
        if tensor is None:
            known = ", ".join(list(tensors)[:8])
            raise CheckpointError(f"sharding names {name!r}, which is not a tensor of the state (first names: {known})")
        if not isinstance(dim, int) or isinstance(dim, bool) or not 0 <= dim < tensor.dim():
            raise CheckpointError(
                f"sharding of {name!r}: dim {dim!r} is not a dimension of its shape {tuple(tensor.shape)}"
            )
        out[name] = dim
    return out


@dataclass(frozen=True)
class SplitTensor:
    """A `sharding=` tensor of a step: the source ranks' parts concatenated along `dim`, in rank order. The
    one place that knows how such a tensor is cut: `part` and `pieces` for a restoring rank serve both
    `plan_reshard` (whole-file reads) and `dtensor.catalog` (byte-range reads)."""

    name: str
    dim: int
    sizes: tuple[int, ...]  # each source rank's length along `dim`
    shape: tuple[int, ...]  # the global shape
    dtype: str

    @property
    def starts(self) -> tuple[int, ...]:
        """Where each source rank's part begins along `dim` in the global tensor."""
        out, position = [], 0
        for size in self.sizes:
            out.append(position)
            position += size
        return tuple(out)

    def part(self, rank: int, world_size: int) -> tuple[int, int]:
        """(start, length) along `dim` of what rank `rank` of `world_size` receives:
        `torch.tensor_split(global, world_size, dim)[rank]`."""
        return _tensor_split_range(self.shape[self.dim], world_size, rank)

    def pieces(self, rank: int, world_size: int) -> list[tuple[int, int, int]]:
        """(source rank, start within its part, length) along `dim` covering `part(rank, world_size)`."""
        return _overlaps(list(self.sizes), *self.part(rank, world_size))


def split_tensor(shards: StepShards, name: str, dim: int, local: int) -> SplitTensor:
    """The `sharding=` tensor `name` (split along `dim`, as source rank `local` records it) across every rank of
    the step. Raises CorruptCheckpoint when a rank does not hold it split along `dim`, or holds it with another
    dtype or other dimensions besides `dim`."""
    reference = shards.manifests[local].tensors[name]
    ref_shape = list(reference.shape)
    sizes = []
    for src in range(shards.world_size):
        manifest = shards.manifests[src]
        entry = manifest.tensors.get(name)
        if entry is None or manifest.sharded_dims.get(name) != dim:
            raise CorruptCheckpoint(
                f"step {shards.step}: rank {src} does not hold {name!r} sharded along dim {dim} like rank {local}"
            )
        if entry.dtype != reference.dtype:
            raise CorruptCheckpoint(
                f"step {shards.step}: shard of {name!r} on rank {src} is {entry.dtype}, on rank {local} "
                f"{reference.dtype}"
            )
        if entry.shape[:dim] + entry.shape[dim + 1 :] != ref_shape[:dim] + ref_shape[dim + 1 :]:
            raise CorruptCheckpoint(
                f"step {shards.step}: shard of {name!r} on rank {src} has shape {entry.shape}, which does not "
                f"line up with {ref_shape} along dim {dim}"
            )
        sizes.append(entry.shape[dim])
    shape = list(ref_shape)
    shape[dim] = sum(sizes)
    return SplitTensor(name, dim, tuple(sizes), tuple(shape), reference.dtype)


def split_tensors(shards: StepShards, local: int) -> dict[str, SplitTensor]:
    """Every `sharding=` tensor of the step, as source rank `local` lists them (`split_tensor`)."""
    return {name: split_tensor(shards, name, dim, local) for name, dim in shards.manifests[local].sharded_dims.items()}


@dataclass(frozen=True)
class ReshardPlan:
    """What rank `rank` of `world_size` reads from a complete step."""

    local_source: int  # the source rank whose structure and rank-local tensors this rank takes
    sources: tuple[int, ...]  # every source rank to read
    pieces: dict[str, list[tuple[int, int, int]]]  # sharded name -> (source rank, start, length) along its dim
    dims: dict[str, int]


def local_source(shards: StepShards, rank: int) -> int:
    """The source rank whose structure, metadata and rank-local tensors rank `rank` takes: its own, or rank 0
    when the step was saved by fewer ranks."""
    return rank if rank < shards.world_size else 0


def plan_reshard(shards: StepShards, rank: int, world_size: int) -> ReshardPlan:
    """Which source ranks and which slices make up rank `rank` of `world_size` (`SplitTensor.pieces`). Raises
    CorruptCheckpoint when the ranks' manifests disagree on what is sharded or on the other dimensions of a
    sharded tensor."""
    local = local_source(shards, rank)
    splits = split_tensors(shards, local)
    pieces = {name: split.pieces(rank, world_size) for name, split in splits.items()}
    needed = {local} | {src for parts in pieces.values() for src, _, _ in parts}
    return ReshardPlan(local, tuple(sorted(needed)), pieces, {name: split.dim for name, split in splits.items()})


def _tensor_split_range(total: int, parts: int, index: int) -> tuple[int, int]:
    """(start, length) of part `index` of `torch.tensor_split(range(total), parts)`."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, base + (1 if index < extra else 0)


def _overlaps(sizes: list[int], begin: int, length: int) -> list[tuple[int, int, int]]:
    """(source, start within it, length) covering [begin, begin + length) of the concatenation of `sizes`."""
    out, offset, end = [], 0, begin + length
    for src, size in enumerate(sizes):
        lo, hi = max(begin, offset), min(end, offset + size)
        if hi > lo:
            out.append((src, lo - offset, hi - lo))
        offset += size
    return out


def assemble(
    plan: ReshardPlan, shards: StepShards, loaded: Mapping[int, Mapping[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """This rank's flat tensors: rank-local ones from `plan.local_source`, sharded ones cut and joined."""
    local = loaded[plan.local_source]
    import torch

    out: dict[str, torch.Tensor] = {}
    for name, tensor in local.items():
        if name not in plan.dims:
            out[name] = tensor
            continue
        dim = plan.dims[name]
        pieces = plan.pieces[name]
        if len(pieces) == 1 and pieces[0][1] == 0 and pieces[0][2] == loaded[pieces[0][0]][name].shape[dim]:
            out[name] = loaded[pieces[0][0]][name]  # exactly one whole source shard: no copy
        elif pieces:
            out[name] = torch.cat([loaded[src][name].narrow(dim, start, n) for src, start, n in pieces], dim=dim)
        else:  # this rank's part is empty (more ranks than rows)
            shape = list(tensor.shape)
            shape[dim] = 0
            out[name] = tensor.new_empty(shape)
    return out


def fill(targets: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copy the restored `tensors` into the caller's `targets` (restore(into=)), after checking that both hold
    the same names, shapes and dtypes (`reader.check_targets`; nothing is written on a mismatch)."""
    shapes = {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}
    check_targets(shapes, targets, note=" (resharded for this rank)")
    import torch

    with torch.no_grad():
        for name, target in targets.items():
            target.copy_(tensors[name])
    return dict(targets)
