"""DCS steps that hold a torch DCP checkpoint (saved by `dcs_tasks.integrations.dcp.DCSStorageWriter`): DCP's
metadata rebuilt from the manifests, the items read back, and the step exported as a DCP directory.

Each rank's manifest holds a JSON record of the DCP items that rank wrote (`metadata["dcp"]`: per item its fully
qualified name, the key of the DCS tensor holding it, and for a tensor chunk its offsets, sizes, the global size
and dtype; DCP's flattening map beside). DCP's own metadata is a pickle; this one is JSON, read as untrusted
input: every field's type and bound checked, each item's recorded shape and dtype checked against the manifest's
own tensor index, each tensor's chunks inside it and covering it, and the records of the ranks in agreement.
Non-tensor values are the bytes DCP serialised them to (`torch.save`), stored as uint8 tensors: DCS never
unpickles them; it hands them to DCP's planner (`load_bytes`) or writes them back out as they were.

`export_dcp` writes a step as a directory DCP's own `FileSystemReader` loads: whole tensors assembled from the
chunks, verified on the way (one rank's files at a time), saved with DCP's `FileSystemWriter`; byte values are
written back unchanged, and the flattening map is the one the step was saved with.
"""

from __future__ import annotations

import dataclasses
import io
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dcs_tasks.checkpoint.format.layout import Manifest
from dcs_tasks.checkpoint.restore import reader, restoring
from dcs_tasks.checkpoint.restore.sharded import StepShards
from dcs_tasks.errors import CheckpointError, CheckpointNotFound, CorruptCheckpoint
from dcs_tasks.storage import Location
from dcs_tasks.tensors import checkpoint_code, parse_dtype

if TYPE_CHECKING:  # torch.distributed.checkpoint is imported by the functions that build DCP objects
    from torch.distributed.checkpoint.metadata import Metadata

DCP_KEY = "dcp"  # the manifest metadata entry holding a rank's DCP record
FORMAT = 1
MAX_BYTES_ITEM = 64 * 1024 * 1024  # a non-tensor value, as DCP serialised it
MAX_ITEMS = 1_000_000  # entries of one rank's DCP record
MAX_NDIM = 64


class NotADCPStep(CheckpointError):
    """The step was not saved through `DCSStorageWriter` (its manifest has no DCP record), so DCP cannot load it."""


@dataclasses.dataclass(frozen=True)
class StoredItem:
    """Where one DCP item is in the step: the saving rank and the DCS tensor holding it."""

    rank: int
    name: str


def open_step_at(run: str, roots: Sequence[tuple[str, Location]], run_root: Location, step: int | None) -> StepShards:
    """The manifests of `step` of `run` (None: the newest step every saving rank committed whose manifests read
    and hold a DCP record), from the first copy under `roots` ((location, run directory), first to last) that
    reads; `run_root` is named in errors. CheckpointNotFound, CorruptCheckpoint, NotADCPStep."""
    found = restoring.find_steps(run, roots, run_root, 1)
    if step is not None:
        if step not in found.copies_of:
            raise CheckpointNotFound(f"run {run!r} has no step {step} every rank committed in {run_root}")
        return _first_copy(found.copies(step), step)
    errors: list[Exception] = []
    for candidate in reversed(found.steps):
        try:
            return _first_copy(found.copies(candidate), candidate)
        except (CorruptCheckpoint, NotADCPStep) as exc:
            errors.append(exc)
    detail = f" (newest error: {errors[0]})" if errors else ""
    raise CheckpointNotFound(f"run {run!r} has no committed DCP step in {run_root}{detail}")


def _first_copy(copies: Sequence[restoring.StepCopy], step: int) -> StepShards:
    first: CorruptCheckpoint | None = None
    for _location, _path, opener in copies:
        try:
            shards = opener()
        except CorruptCheckpoint as exc:
            first = first or exc
            continue
        for rank, manifest in shards.manifests.items():
            if DCP_KEY not in manifest.metadata:
                raise NotADCPStep(f"step {step} (rank {rank}) was not saved through DCSStorageWriter")
        return shards
    assert first is not None
    raise first


def metadata_of(shards: StepShards) -> Metadata:
    """DCP's `Metadata` of a step, rebuilt from every rank's manifest (its DCP record checked against the
    manifest's own tensor index); `storage_data` maps each item to a `StoredItem`. CorruptCheckpoint when a
    record is malformed or the ranks' records disagree."""
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    state: dict[str, Any] = {}
    storage: dict[Any, StoredItem] = {}
    planner_data: dict[str, tuple[Any, ...]] = {}
    for rank in sorted(shards.manifests):
        manifest = shards.manifests[rank]
        _add_rank(shards.step, rank, manifest, state, storage, planner_data)
    for fqn, md in state.items():
        if isinstance(md, TensorStorageMetadata):
            covered = sum(math.prod(c.sizes) for c in md.chunks)
            if covered != math.prod(md.size):
                whole = math.prod(md.size)
                raise CorruptCheckpoint(f"step {shards.step}: the chunks of {fqn!r} hold {covered} elements of {whole}")
    return Metadata(state_dict_metadata=dict(state), planner_data=planner_data, storage_data=storage)


def _add_rank(
    step: int,
    rank: int,
    manifest: Manifest,
    state: dict[str, Any],
    storage: dict[Any, StoredItem],
    planner_data: dict[str, tuple[Any, ...]],
) -> None:
    where = f"step {step} rank {rank}: DCP record"

    def bad(reason: str) -> CorruptCheckpoint:
        return CorruptCheckpoint(f"{where}: {reason}")

    record = manifest.metadata.get(DCP_KEY)
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise bad(f"not a format {FORMAT} record")
    items, mappings = record.get("items"), record.get("planner_data", [])
    if not isinstance(items, list) or len(items) > MAX_ITEMS or not isinstance(mappings, list):
        raise bad("malformed")
    names = _top_level_names(manifest.structure)
    for raw in items:
        if not isinstance(raw, dict) or not isinstance(raw.get("fqn"), str) or not isinstance(raw.get("key"), str):
            raise bad("an item is malformed")
        fqn, key = raw["fqn"], raw["key"]
        name = names.get(key)
        entry = None if name is None else manifest.tensors.get(name)
        if name is None or entry is None:
            raise bad(f"{fqn!r} is not among the step's tensors")
        if raw.get("kind") == "bytes":
            _add_bytes(fqn, name, entry, rank, state, storage, bad)
        else:
            _add_chunk(raw, name, entry, rank, state, storage, bad)
    _add_mappings(mappings, planner_data, bad)


def _add_bytes(
    fqn: str,
    name: str,
    entry: Any,
    rank: int,
    state: dict[str, Any],
    storage: dict[Any, StoredItem],
    bad: Callable[[str], CorruptCheckpoint],
) -> None:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    if entry.dtype != "U8" or len(entry.shape) != 1 or entry.shape[0] > MAX_BYTES_ITEM:
        raise bad(f"value {fqn!r} is not a byte blob of at most {MAX_BYTES_ITEM} bytes")
    if fqn in state and not isinstance(state[fqn], BytesStorageMetadata):
        raise bad(f"{fqn!r} is a tensor on another rank")
    state[fqn] = BytesStorageMetadata()
    storage.setdefault(MetadataIndex(fqn), StoredItem(rank, name))


def _add_chunk(
    raw: dict[str, Any],
    name: str,
    entry: Any,
    rank: int,
    state: dict[str, Any],
    storage: dict[Any, StoredItem],
    bad: Callable[[str], CorruptCheckpoint],
) -> None:
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    fqn, key = raw["fqn"], raw["key"]
    offsets, sizes, size = (_dims(raw.get(k)) for k in ("offsets", "sizes", "size"))
    if offsets is None or sizes is None or size is None or not len(offsets) == len(sizes) == len(size):
        raise bad(f"tensor {fqn!r} has malformed offsets or sizes")
    if any(o + s > d for o, s, d in zip(offsets, sizes, size, strict=True)):
        raise bad(f"a chunk of {fqn!r} lies outside the tensor")
    try:
        dtype = parse_dtype(str(raw.get("dtype")))
        code = checkpoint_code(dtype)
    except ValueError as exc:
        raise bad(f"tensor {fqn!r}: {exc}") from exc
    if list(entry.shape) != sizes or entry.dtype != code:
        raise bad(f"chunk {key!r} is stored as {entry.dtype}{entry.shape}, recorded as {dtype}{sizes}")
    md = state.get(fqn)
    if md is None:
        props = TensorProperties(dtype=dtype, requires_grad=raw.get("requires_grad") is True)
        md = state[fqn] = TensorStorageMetadata(properties=props, size=torch.Size(size), chunks=[])
    if not isinstance(md, TensorStorageMetadata) or list(md.size) != size or md.properties.dtype != dtype:
        raise bad(f"tensor {fqn!r} disagrees with another rank's record of it")
    index = MetadataIndex(fqn, offsets)
    if index in storage:
        return  # the same chunk saved twice (DCP deduplicates; a custom planner may not): the first serves
    md.chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
    storage[index] = StoredItem(rank, name)


def _add_mappings(
    mappings: list[Any], planner_data: dict[str, tuple[Any, ...]], bad: Callable[[str], CorruptCheckpoint]
) -> None:
    for pair in mappings:
        if (
            isinstance(pair, list)
            and len(pair) == 2
            and isinstance(pair[0], str)
            and isinstance(pair[1], list)
            and 0 < len(pair[1]) <= MAX_NDIM
            and all(isinstance(p, str) or (isinstance(p, int) and not isinstance(p, bool)) for p in pair[1])
        ):
            planner_data.setdefault(pair[0], tuple(pair[1]))
        else:
            raise bad("malformed flattening map")


def _top_level_names(structure: Any) -> dict[str, str]:
    """key -> stored tensor name of the flat dict a writer saved (ties: both keys name one stored tensor)."""
    out: dict[str, str] = {}
    if isinstance(structure, dict) and structure.get("k") in ("dict", "odict"):
        for key, value in zip(structure["keys"], structure["values"], strict=True):
            if isinstance(value, dict) and value.get("k") == "tensor" and isinstance(key, dict):
                out[str(key.get("v"))] = str(value["name"])
    return out


def _dims(value: Any) -> list[int] | None:
    if not isinstance(value, list) or len(value) > MAX_NDIM:
        return None
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value):
        return None
    return [int(d) for d in value]


def read_items(
    shards: StepShards,
    items: Mapping[int, Sequence[Any]],
    where: Callable[[Any], StoredItem],
    verify: bool = True,
) -> Iterator[tuple[Any, torch.Tensor]]:
    """(item, the DCS tensor holding it) for `items` (saving rank -> items; `where(item)` names its tensor), one
    rank's files at a time, each file read once and verified (CorruptCheckpoint names a file that fails)."""
    for rank in sorted(items):
        tensors = reader.load_tensors(shards.dirs[rank], shards.manifests[rank], verify=verify)
        for item in items[rank]:
            yield item, tensors[where(item).name]
        del tensors


@dataclasses.dataclass(frozen=True)
class ExportResult:
    step: int
    out_dir: Path
    tensors: int
    values: int
    total_bytes: int


def export_dcp(run: str, run_root: Location, out: Path, step: int | None = None) -> ExportResult:
    """Write step `step` (default: the newest DCP step) of the run at `run_root` as a DCP directory at `out` (new,
    or empty). CheckpointError when `out` holds files, NotADCPStep for a step not saved through DCP."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out} exists and is not an empty directory")
    shards = open_step_at(run, [("primary", run_root)], run_root, step)
    metadata = metadata_of(shards)
    state: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            state[fqn] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    by_rank: dict[int, list[Any]] = {}
    for index, stored in metadata.storage_data.items():
        by_rank.setdefault(stored.rank, []).append(index)
    total = 0
    for index, tensor in read_items(shards, by_rank, metadata.storage_data.__getitem__):
        total += tensor.numel() * tensor.element_size()
        if index.offset is None:
            state[index.fqn] = _Raw(tensor.numpy().tobytes())
            continue
        target = state[index.fqn]
        for dim, (start, length) in enumerate(zip(index.offset, tensor.shape, strict=True)):
            target = target.narrow(dim, start, length)
        target.copy_(tensor)
    out.mkdir(parents=True, exist_ok=True)
    planner = _ExportPlanner(metadata.planner_data)
    dcp.save(state, storage_writer=FileSystemWriter(str(out)), planner=planner, no_dist=True)
    values = sum(isinstance(v, _Raw) for v in state.values())
    return ExportResult(shards.step, out, len(state) - values, values, total)


@dataclasses.dataclass(frozen=True)
class _Raw:
    """A non-tensor value as the bytes DCP serialised it to: written back unchanged."""

    data: bytes


def _export_planner_class() -> type:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import WriteItemType

    class ExportPlanner(DefaultSavePlanner):
        """DCP's default planner, with byte values passed through as stored and the step's flattening map."""

        def __init__(self, mappings: dict[str, tuple[Any, ...]]) -> None:
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
            self._mappings = mappings

        def create_global_plan(self, all_plans: list[Any]) -> tuple[list[Any], Any]:
            plans, metadata = super().create_global_plan(all_plans)
            if self._mappings:
                metadata = dataclasses.replace(metadata, planner_data=dict(self._mappings))
                self.metadata = metadata
            return plans, metadata

        def transform_object(self, write_item: Any, object: Any) -> Any:
            if write_item.type == WriteItemType.BYTE_IO and isinstance(object, _Raw):
                return io.BytesIO(object.data)
            return super().transform_object(write_item, object)

    return ExportPlanner


def _ExportPlanner(mappings: dict[str, tuple[Any, ...]]) -> Any:
    return _export_planner_class()(mappings)


__all__ = [
    "DCP_KEY",
    "ExportResult",
    "NotADCPStep",
    "StoredItem",
    "export_dcp",
    "metadata_of",
    "open_step_at",
    "read_items",
]
