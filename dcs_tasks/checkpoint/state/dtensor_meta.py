"""Where a torch `DTensor`'s local shard sits, and which rank writes it: the state-stage half of DTensor support
(`restore/boxread.py` has the story, and restores).

`local_part` flattens a DTensor to its local shard (`to_local()`, no gather) plus a `ShardMeta` (global shape,
offset, placements, mesh), refusing with `UnsupportedPlacement` what DCS cannot save; `assign_owners` picks the
one rank that writes each shard several ranks hold; `chunk_sums` hashes the per-chunk checksums partial
restores verify. `structure.flatten_state` uses this module; `boxread` re-exports every name.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dcs_tasks.checkpoint.format.layout import SUM_CHUNK_BYTES, ChunkSums, Layout, ShardEntry, chunk_sum
from dcs_tasks.errors import CheckpointError, StagingError

if TYPE_CHECKING:
    import torch

MAX_MESH_DIMS = 2


class UnsupportedPlacement(StagingError):
    """A DTensor whose placements or mesh DCS cannot save or restore (the message names both)."""


@dataclass(frozen=True)
class ShardMeta:
    """Where this rank's local shard of a DTensor sits; `shard_dims[i]` is the tensor dimension mesh
    dimension i splits (None: replicated along it). `mesh_ranks` are the mesh's global ranks, row-major."""

    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    local_shape: tuple[int, ...]
    placements: tuple[str, ...]
    shard_dims: tuple[int | None, ...]
    mesh_shape: tuple[int, ...]
    mesh_ranks: tuple[int, ...]
    coordinate: tuple[int, ...]
    itemsize: int
    source: Any = field(default=None, compare=False, repr=False)  # the DTensor itself

    @property
    def rank(self) -> int:
        return self.mesh_ranks[_flat_index(self.coordinate, self.mesh_shape)]

    def entry(self) -> ShardEntry:
        return ShardEntry(
            global_shape=list(self.global_shape),
            offset=list(self.offset),
            placements=list(self.placements),
            mesh_shape=list(self.mesh_shape),
        )


_DTENSOR: list[Any] = []


def _dtensor_type() -> Any:
    if not _DTENSOR:
        found: Any = None
        try:
            from torch.distributed.tensor import DTensor

            found = DTensor
        except ImportError:  # torch built without distributed: no DTensor can exist
            pass
        _DTENSOR.append(found)
    return _DTENSOR[0]


def is_dtensor(tensor: Any) -> bool:
    kind = _dtensor_type()
    return kind is not None and isinstance(tensor, kind)


def chunk_range(size: int, parts: int, index: int) -> tuple[int, int]:
    """(start, length) of piece `index` of `torch.chunk(range(size), parts)` (empty past the last piece)."""
    step = -(-size // parts)
    start = min(index * step, size)
    return start, max(0, min(step, size - start))


def box_of(
    global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], coordinate: tuple[int, ...], dims: Iterable[int | None]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, offset) of the shard at `coordinate`: each sharded mesh dimension, left to right,
    chunks what the previous ones left of its tensor dimension."""
    offset, size = [0] * len(global_shape), list(global_shape)
    for mesh_dim, dim in enumerate(dims):
        if dim is not None:
            start, length = chunk_range(size[dim], mesh_shape[mesh_dim], coordinate[mesh_dim])
            offset[dim] += start
            size[dim] = length
    return tuple(size), tuple(offset)


def _flat_index(coordinate: tuple[int, ...], shape: tuple[int, ...]) -> int:
    index = 0
    for c, s in zip(coordinate, shape, strict=True):
        index = index * s + c
    return index


def _placement_dims(tensor: Any, where: str) -> tuple[tuple[int | None, ...], tuple[str, ...]]:
    from torch.distributed.tensor import Replicate, Shard

    mesh = tensor.device_mesh
    if mesh.ndim > MAX_MESH_DIMS:
        raise UnsupportedPlacement(
            f"cannot checkpoint DTensor at {where!r}: its device mesh has {mesh.ndim} dimensions "
            f"{tuple(mesh.shape)}; 1-D and 2-D meshes are supported"
        )
    dims: list[int | None] = []
    for placement in tensor.placements:
        if type(placement) is Shard:
            dims.append(placement.dim % max(tensor.dim(), 1))
        elif type(placement) is Replicate:
            dims.append(None)
        else:
            raise UnsupportedPlacement(
                f"cannot checkpoint DTensor at {where!r}: placement {placement!r} is not supported "
                "(Shard(d) and Replicate() are; redistribute it first)"
            )
    return tuple(dims), tuple(str(p) for p in tensor.placements)


def local_part(tensor: Any, where: str) -> tuple[torch.Tensor, ShardMeta]:
    """The DTensor's local shard (no communication) and where it sits. Raises UnsupportedPlacement."""
    dims, names = _placement_dims(tensor, where)
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise UnsupportedPlacement(f"cannot checkpoint DTensor at {where!r}: this rank is not in its device mesh")
    mesh_shape = tuple(int(s) for s in mesh.shape)
    global_shape = tuple(int(s) for s in tensor.shape)
    local_shape, offset = box_of(global_shape, mesh_shape, tuple(coordinate), dims)
    local = tensor.to_local()
    if tuple(local.shape) != local_shape:
        raise UnsupportedPlacement(
            f"cannot checkpoint DTensor at {where!r} ({', '.join(names)}): its local shard has shape "
            f"{tuple(local.shape)}, not {local_shape} where torch.chunk puts it"
        )
    meta = ShardMeta(
        global_shape=global_shape,
        offset=offset,
        local_shape=local_shape,
        placements=names,
        shard_dims=dims,
        mesh_shape=mesh_shape,
        mesh_ranks=tuple(int(r) for r in mesh.mesh.reshape(-1).tolist()),
        coordinate=tuple(int(c) for c in coordinate),
        itemsize=local.element_size(),
        source=tensor,
    )
    return local, meta


def check_ranks(metas: Mapping[str, ShardMeta], rank: int, world_size: int) -> None:
    """Every DTensor's mesh must place this process at the checkpointer's `rank` and stay inside its world."""
    for name, meta in metas.items():
        if meta.rank != rank or max(meta.mesh_ranks) >= world_size:
            raise CheckpointError(
                f"DTensor {name!r} lives on mesh ranks {list(meta.mesh_ranks)} with this process as rank "
                f"{meta.rank}, but the checkpointer is rank {rank} of {world_size}: make it "
                "Checkpointer(run, rank=dist.get_rank(), world_size=dist.get_world_size())"
            )


def assign_owners(metas: Mapping[str, ShardMeta]) -> dict[str, int]:
    """name -> the global rank that writes this rank's shard of it. Shards held by several ranks go to the
    holder with the fewest bytes assigned so far (ties: lowest rank); the same answer on every rank."""
    load: dict[int, int] = {}
    owners: dict[str, int] = {}
    for name, meta in metas.items():
        groups: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
        for coordinate in itertools.product(*(range(s) for s in meta.mesh_shape)):
            key = tuple(c for c, d in zip(coordinate, meta.shard_dims, strict=True) if d is not None)
            groups.setdefault(key, []).append(coordinate)
        mine = tuple(c for c, d in zip(meta.coordinate, meta.shard_dims, strict=True) if d is not None)
        for key in sorted(groups):
            members = groups[key]
            shape, _ = box_of(meta.global_shape, meta.mesh_shape, members[0], meta.shard_dims)
            ranks = [meta.mesh_ranks[_flat_index(c, meta.mesh_shape)] for c in members]
            owner = min(ranks, key=lambda r: (load.get(r, 0), r))
            load[owner] = load.get(owner, 0) + math.prod(shape) * meta.itemsize
            if key == mine:
                owners[name] = owner
    return owners


def owned(metas: Mapping[str, ShardMeta], rank: int) -> set[str]:
    """The DTensor names whose local shard this rank writes."""
    return {name for name, owner in assign_owners(metas).items() if owner == rank}


def chunk_sums(staging: torch.Tensor, layout: Layout, chunk_bytes: int = SUM_CHUNK_BYTES) -> ChunkSums:
    """Checksums of every `chunk_bytes` piece of every tensor of `layout`, read from the staging bytes."""
    sums: dict[str, list[str]] = {}
    for f in layout.files:
        for slot in f.slots:
            begin = f.offset + f.data_start + slot.begin
            data = staging[begin : begin + slot.spec.nbytes].numpy().data
            pieces = range(0, slot.spec.nbytes, chunk_bytes)
            sums[slot.spec.name] = [chunk_sum(data[i : i + chunk_bytes]) for i in pieces]
    return ChunkSums(chunk_bytes=chunk_bytes, sums=sums)
