"""Reading any box of a saved tensor from the pieces that hold it, verified chunk by chunk (`RangeReader`: only the
checksum chunks that cover the box are read), for plain, `sharding=` and DTensor checkpoints alike; and torch
`DTensor` state: save each rank's local shard with its place in the global tensor, restore any part.

Save. A DTensor whose placements are `Shard(d)` or `Replicate()` on a 1-D or 2-D `DeviceMesh` is flattened
to its local shard (`to_local()`, no gather) plus a `ShardMeta`: global shape, the shard's offset along every
dimension, the placements and the mesh. Shards are where `torch.chunk` puts them (ceil-sized pieces, trailing
ones shorter or empty; not `tensor_split`), nested left to right over the mesh dimensions as DTensor does;
the shard's actual local shape is checked against that, so a layout DCS does not understand is refused rather
than saved wrongly. Ranks holding the same shard (every rank for `Replicate()`, the ranks along a replicated
mesh dimension otherwise) write it once: `assign_owners` gives each such group of shards to the member with
the fewest bytes assigned so far, walking the tensors in state order. It reads only the global metadata
every rank has, so every rank computes the same owners without talking to the others. Anything else
(`Partial`, `_StridedShard`, meshes of 3 or more dimensions) raises `UnsupportedPlacement` naming the
placement and the state path.

Checksums of parts. A state with DTensors also records per-chunk checksums of every tensor it writes
(`layout.ChunkSums`: xxh3_64 of each `SUM_CHUNK_BYTES` piece of the tensor's bytes, hashed from the staging
buffer, i.e. the bytes the workers persist). The whole-file xxh3_128 checksums stay as before.

Restore (`restore_step`). Each target tensor asks for a box of the global tensor: a DTensor target its own
local shard (its mesh and world size may differ from the saving ones), a plain target the whole tensor (or,
for `sharding=` checkpoints, its `tensor_split` part, as before). For every saved piece overlapping the box,
only the checksum chunks covering the overlap are read (`needed_runs`): for a split along dimension 0, or any
split whose trailing dimensions are whole, that is one contiguous byte range; otherwise the overlap is a set
of strided rows, and the chunks any row touches are read (merged into contiguous runs; rows shorter than a
chunk mean most chunks of the span). Every chunk read is checked against its checksum before its bytes are
used, so a partial read verifies exactly the bytes it reads; bytes not read are not verified. Checkpoints
without chunk checksums (written before DTensor support, or without DTensors) are read a whole part at a time
and verified with the file checksums, as `reader.load_tensors` does; so are pieces in compressed files
(`dcs_tasks.checkpoint.format.compression`), whose byte ranges cannot be read in place.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from dcs_tasks.checkpoint.format.layout import (
    CODE_DTYPES,
    Manifest,
    TensorEntry,
    chunk_sum,
)
from dcs_tasks.checkpoint.restore import reader
from dcs_tasks.checkpoint.restore.sharded import SplitTensor, local_source, split_tensors
from dcs_tasks.checkpoint.state.dtensor_meta import MAX_MESH_DIMS as MAX_MESH_DIMS
from dcs_tasks.checkpoint.state.dtensor_meta import ShardMeta as ShardMeta
from dcs_tasks.checkpoint.state.dtensor_meta import UnsupportedPlacement as UnsupportedPlacement
from dcs_tasks.checkpoint.state.dtensor_meta import assign_owners as assign_owners
from dcs_tasks.checkpoint.state.dtensor_meta import box_of as box_of
from dcs_tasks.checkpoint.state.dtensor_meta import check_ranks as check_ranks
from dcs_tasks.checkpoint.state.dtensor_meta import chunk_range as chunk_range
from dcs_tasks.checkpoint.state.dtensor_meta import chunk_sums as chunk_sums
from dcs_tasks.checkpoint.state.dtensor_meta import is_dtensor as is_dtensor
from dcs_tasks.checkpoint.state.dtensor_meta import local_part as local_part
from dcs_tasks.checkpoint.state.dtensor_meta import owned as owned
from dcs_tasks.checkpoint.state.structure import flatten_state, unflatten_state
from dcs_tasks.checkpoint.store.ledger.steps import StepShards
from dcs_tasks.checkpoint.store.reads import stepcheck
from dcs_tasks.errors import CorruptCheckpoint, StateMismatch
from dcs_tasks.storage import Location, store_of

_READ = [0]  # data bytes read by restore_step in this process (bytes_read_total)
Box = tuple[tuple[int, ...], tuple[int, ...]]  # (lo, hi) along every dimension of the global tensor


# --- restore ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Piece:
    """One saved tensor that is part of a global tensor: rank `src`'s `entry`, starting at `offset`."""

    src: int
    step_dir: Location
    manifest: Manifest
    entry: TensorEntry
    offset: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.entry.shape)


@dataclass
class Catalog:
    """Every tensor this rank can restore from a step: its global shape, dtype, kind and saved pieces.
    Kinds: "dtensor" (pieces from any rank), "split" (`sharding=`), "local" (from the local source rank)."""

    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    dtypes: dict[str, str] = field(default_factory=dict)
    kinds: dict[str, str] = field(default_factory=dict)
    splits: dict[str, SplitTensor] = field(default_factory=dict)  # the "split" tensors
    pieces: dict[str, list[Piece]] = field(default_factory=dict)

    def add(self, name: str, kind: str, shape: tuple[int, ...], piece: Piece, step: int) -> None:
        known = self.shapes.setdefault(name, shape)
        dtype = self.dtypes.setdefault(name, piece.entry.dtype)
        if self.kinds.setdefault(name, kind) != kind or known != shape or dtype != piece.entry.dtype:
            raise CorruptCheckpoint(
                f"step {step}: rank {piece.src} holds {name!r} as {kind} {piece.entry.dtype} {list(shape)}, "
                f"another rank as {self.kinds[name]} {dtype} {list(known)}"
            )
        self.pieces.setdefault(name, []).append(piece)


def catalog(shards: StepShards, local: int) -> Catalog:
    """What the step holds, checked for consistency across ranks (CorruptCheckpoint names the tensor)."""
    cat = Catalog()
    for src, manifest in sorted(shards.manifests.items()):
        for name, shard in (manifest.dtensors or {}).items():
            piece = Piece(src, shards.dirs[src], manifest, manifest.tensors[name], tuple(shard.offset))
            cat.add(name, "dtensor", tuple(shard.global_shape), piece, shards.step)
    reference = shards.manifests[local]
    cat.splits = split_tensors(shards, local)
    for name, split in cat.splits.items():
        for src, start in enumerate(split.starts):
            manifest = shards.manifests[src]
            offset = [0] * len(split.shape)
            offset[split.dim] = start
            piece = Piece(src, shards.dirs[src], manifest, manifest.tensors[name], tuple(offset))
            cat.add(name, "split", split.shape, piece, shards.step)
    for name, entry in reference.tensors.items():
        if name not in cat.kinds:
            piece = Piece(local, shards.dirs[local], reference, entry, (0,) * len(entry.shape))
            cat.add(name, "local", tuple(entry.shape), piece, shards.step)
    for name, pieces in cat.pieces.items():
        if sum(math.prod(p.shape) for p in pieces) != math.prod(cat.shapes[name]):
            raise CorruptCheckpoint(f"step {shards.step}: the saved pieces of {name!r} do not cover its global shape")
    return cat


def default_box(cat: Catalog, name: str, rank: int, world_size: int) -> Box:
    """What a plain (non-DTensor) target of `name` receives: the whole tensor, or for a `sharding=` tensor
    this rank's `tensor_split` part (`SplitTensor.part`, as `sharded.plan_reshard` reads it)."""
    shape = cat.shapes[name]
    lo, hi = [0] * len(shape), list(shape)
    split = cat.splits.get(name)
    if split is not None:
        start, length = split.part(rank, world_size)
        lo[split.dim], hi[split.dim] = start, start + length
    return tuple(lo), tuple(hi)


class RangeReader:
    """Reads boxes of saved pieces: only the checksum chunks that overlap, each verified (see module doc);
    pieces without chunk checksums come from a whole, file-verified read of their rank's part."""

    def __init__(self, verify: bool) -> None:
        self.verify = verify
        self.bytes_read = 0
        self._checked: set[Location] = set()
        self._whole: dict[Location, dict[str, torch.Tensor]] = {}

    def _add(self, nbytes: int) -> None:
        self.bytes_read += nbytes
        _READ[0] += nbytes

    def read(self, piece: Piece, name: str, lo: tuple[int, ...], hi: tuple[int, ...]) -> torch.Tensor:
        """The piece's elements [lo, hi) (relative to the piece), as a tensor view."""
        manifest = piece.manifest
        sums = manifest.chunks.sums.get(name) if manifest.chunks is not None else None
        if sums is None or _compressed(manifest, piece.entry.file):
            if piece.step_dir not in self._whole:
                self._whole[piece.step_dir] = reader.load_tensors(piece.step_dir, manifest, verify=self.verify)
                self._add(manifest.total_bytes)
            whole = self._whole[piece.step_dir][name]
            return whole[tuple(slice(a, b) for a, b in zip(lo, hi, strict=True))]
        if piece.step_dir not in self._checked:
            stepcheck.check_files(piece.step_dir, manifest)  # sizes and headers agree: no data bytes read
            self._checked.add(piece.step_dir)
        assert manifest.chunks is not None
        return self._read_chunks(piece, name, lo, hi, sums, manifest.chunks.chunk_bytes)

    def _read_chunks(
        self, piece: Piece, name: str, lo: tuple[int, ...], hi: tuple[int, ...], sums: list[str], chunk: int
    ) -> torch.Tensor:
        entry = piece.entry
        dtype = CODE_DTYPES[entry.dtype]
        shape = piece.shape
        begin, end = entry.offsets
        runs = needed_runs(shape, dtype.itemsize, lo, hi, chunk)
        if not runs:
            return torch.empty([b - a for a, b in zip(lo, hi, strict=True)], dtype=dtype)
        span_lo, span_hi = runs[0][0] * chunk, min(runs[-1][1] * chunk, end - begin)
        buf = torch.empty(span_hi - span_lo, dtype=torch.uint8)
        listed = next(f for f in piece.manifest.files if f.name == entry.file)  # validated: it is listed
        path = listed.stored_path(piece.step_dir)
        store = store_of(path)
        for c0, c1 in runs:  # one ranged read (a GET in an object store) per run of needed chunks
            b0, b1 = c0 * chunk, min(c1 * chunk, end - begin)
            view = buf[b0 - span_lo : b1 - span_lo].numpy().data
            store.read_into(path, begin + b0, [view])
            self._add(b1 - b0)
            if self.verify:
                _check_chunks(view, c0, chunk, sums, path, name)
        strides = _strides(shape)
        first = sum(a * s for a, s in zip(lo, strides, strict=True)) - span_lo // dtype.itemsize
        size = [b - a for a, b in zip(lo, hi, strict=True)]
        return buf.view(dtype).as_strided(size, strides, first)


def _compressed(manifest: Manifest, file: str) -> bool:
    """Whether `file` is stored compressed: its byte ranges cannot be read in place, so the piece comes from
    the whole part, decompressed once per restore and verified with the file checksums."""
    return any(f.compression for f in manifest.files if f.name == file)


def _check_chunks(view: memoryview, first: int, chunk: int, sums: list[str], path: Location, name: str) -> None:
    for i in range(0, len(view), chunk):
        index = first + i // chunk
        if chunk_sum(view[i : i + chunk]) != sums[index]:
            raise CorruptCheckpoint(
                f"checkpoint file {path}: chunk {index} of tensor {name!r} fails its checksum", str(path)
            )


def _strides(shape: tuple[int, ...]) -> list[int]:
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= size
    return strides[::-1]


def needed_runs(
    shape: tuple[int, ...], itemsize: int, lo: tuple[int, ...], hi: tuple[int, ...], chunk: int
) -> list[tuple[int, int]]:
    """[first, end) chunk index runs covering the bytes of elements [lo, hi) of a row-major tensor: the
    box is split into contiguous pieces (one per index of the dimensions before the last partial one),
    and every chunk a piece touches is marked."""
    if any(b <= a for a, b in zip(lo, hi, strict=True)):
        return []
    nbytes = math.prod(shape) * itemsize
    count = -(-nbytes // chunk)
    if not shape:
        return [(0, count)]
    k = len(shape) - 1
    while k > 0 and lo[k] == 0 and hi[k] == shape[k]:
        k -= 1
    strides = _strides(shape)
    starts = torch.tensor([lo[k] * strides[k]], dtype=torch.int64)
    for d in range(k - 1, -1, -1):
        starts = (torch.arange(lo[d], hi[d], dtype=torch.int64) * strides[d]).view(-1, 1) + starts.view(1, -1)
    starts = starts.reshape(-1) * itemsize
    length = (hi[k] - lo[k]) * strides[k] * itemsize
    marks = torch.zeros(count + 1, dtype=torch.int64)
    ones = torch.ones_like(starts)
    marks.index_add_(0, starts // chunk, ones)
    marks.index_add_(0, (starts + length - 1) // chunk + 1, -ones)
    covered = torch.cat([torch.zeros(1, dtype=torch.int64), (marks.cumsum(0)[:count] > 0).to(torch.int64)])
    edges = covered.diff(append=torch.zeros(1, dtype=torch.int64))
    firsts = (edges == 1).nonzero().reshape(-1).tolist()
    ends = (edges == -1).nonzero().reshape(-1).tolist()
    return list(zip(firsts, ends, strict=True))


Put = Callable[[torch.Tensor, torch.Tensor], None]
"""put(dest, part): write `part` (host memory) into `dest` (a slice of a target); `device.Uploader.put` for device
targets (page-locked, on a side stream), `Tensor.copy_` otherwise."""


def _copy(dest: torch.Tensor, part: torch.Tensor) -> None:
    dest.copy_(part)


def fill_box(cat: Catalog, name: str, box: Box, dest: torch.Tensor, source: RangeReader, put: Put = _copy) -> None:
    """Copy the global elements [lo, hi) of `name` into `dest` (shaped hi - lo) from every overlapping piece."""
    lo, hi = box
    for piece in cat.pieces[name]:
        p_hi = tuple(o + s for o, s in zip(piece.offset, piece.shape, strict=True))
        a = tuple(max(x, y) for x, y in zip(lo, piece.offset, strict=True))
        b = tuple(min(x, y) for x, y in zip(hi, p_hi, strict=True))
        if any(y <= x for x, y in zip(a, b, strict=True)):
            continue
        part = source.read(
            piece,
            name,
            tuple(x - o for x, o in zip(a, piece.offset, strict=True)),
            tuple(y - o for y, o in zip(b, piece.offset, strict=True)),
        )
        with torch.no_grad():
            put(dest[tuple(slice(x - c, y - c) for x, y, c in zip(a, b, lo, strict=True))], part)


def _size(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in zip(*box, strict=True))


def plan_targets(
    cat: Catalog, flat: Any, rank: int, world_size: int, strict: bool
) -> dict[str, tuple[Box, torch.Tensor]]:
    """name -> (the global box it receives, the tensor to write), every name, shape and dtype checked
    before anything is read (StateMismatch names the first difference). `flat` is the flattened target:
    DTensor targets are their local shards. Not `strict`: checkpoint tensors the target lacks are ignored;
    a target tensor the checkpoint lacks is always an error."""
    missing = [name for name in flat.tensors if name not in cat.pieces]
    if missing:
        raise StateMismatch(f"checkpoint has no tensor {missing[0]!r} that the target state holds")
    extra = [name for name in cat.pieces if name not in flat.tensors]
    if strict and extra:
        raise StateMismatch(
            f"checkpoint tensor {extra[0]!r} has no counterpart in the target state "
            "(restore(..., strict=False) fills only the tensors the target holds)"
        )
    plan: dict[str, tuple[Box, torch.Tensor]] = {}
    for name, dest in flat.tensors.items():
        meta: ShardMeta | None = flat.dtensors.get(name)
        dtype = CODE_DTYPES[cat.dtypes[name]]
        if meta is not None:
            if meta.global_shape != cat.shapes[name]:
                raise StateMismatch(
                    f"tensor {name!r}: checkpoint holds {dtype} {list(cat.shapes[name])} globally, the target "
                    f"DTensor is {dest.dtype} {list(meta.global_shape)}"
                )
            box: Box = (meta.offset, tuple(o + s for o, s in zip(meta.offset, meta.local_shape, strict=True)))
        else:
            box = default_box(cat, name, rank, world_size)
        if tuple(dest.shape) != _size(box) or dest.dtype != dtype:
            raise StateMismatch(
                f"tensor {name!r}: checkpoint has {dtype} {_size(box)} for this rank, "
                f"target has {dest.dtype} {tuple(dest.shape)}"
            )
        plan[name] = (box, dest)
    return plan


def restore_step(
    shards: StepShards, rank: int, world_size: int, into: Any, verify: bool, strict: bool, put: Put = _copy
) -> tuple[Any, int]:
    """(the restored state, data bytes read) for rank `rank` of `world_size`. Without `into`, DTensors come
    back as whole plain tensors, `sharding=` tensors as this rank's part, the rest from the local source rank.
    With `into`, its tensors are filled in place (DTensors: their local shard); the state returned is the
    checkpoint's structure over them, or `into` itself when not `strict`. `put` writes each piece into its target
    (device targets: `device.Uploader.put`)."""
    local = local_source(shards, rank)
    cat = catalog(shards, local)
    source = RangeReader(verify)
    structure = shards.manifests[local].structure
    if into is None:
        return unflatten_state(structure, _read_all(cat, rank, world_size, source)), source.bytes_read
    flat = flatten_state(into)
    for name, (box, dest) in plan_targets(cat, flat, rank, world_size, strict).items():
        fill_box(cat, name, box, dest, source, put)
    if not strict:
        return into, source.bytes_read
    originals = {name: flat.dtensors[name].source if name in flat.dtensors else t for name, t in flat.tensors.items()}
    return unflatten_state(structure, originals), source.bytes_read


def _read_all(cat: Catalog, rank: int, world_size: int, source: RangeReader) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name in cat.pieces:
        box = default_box(cat, name, rank, world_size)
        out[name] = torch.empty(_size(box), dtype=CODE_DTYPES[cat.dtypes[name]])
        fill_box(cat, name, box, out[name], source)
    return out


def read_flat(
    shards: StepShards, *, rank: int = 0, world_size: int = 1, verify: bool = True
) -> dict[str, torch.Tensor]:
    """Stored tensor name -> tensor, as rank `rank` of `world_size` restores it without a target: DTensors
    whole, `sharding=` tensors this rank's `tensor_split` part, the rest from the local source rank. With
    the defaults: every tensor of any complete step (plain, `sharding=` or DTensor) as one trainer sees it
    (e.g. for exporting). Reads like `restore_step` (chunk-verified where chunk checksums exist)."""
    return _read_all(catalog(shards, local_source(shards, rank)), rank, world_size, RangeReader(verify))


def bytes_read_total() -> int:
    """Checkpoint data bytes this process read through `restore_step` so far (for tests and benchmarks)."""
    return _READ[0]
