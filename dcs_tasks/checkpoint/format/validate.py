"""Checks of committed steps as untrusted input, on bytes and parsed models only: manifests, safetensors header
entries and the structure's form. No file or network I/O here: reading a step from its store and checking its
files against these rules is `dcs_tasks.checkpoint.store.reads.stepcheck` (`read_manifest`, `check_files`).

Anyone who can write into the checkpoint directory can hand restore a crafted step, so nothing in it is
believed before it is checked, and everything is checked before memory is allocated or a data file is read:
- `check_manifest`: the format version is known; file names are plain basenames of
  safetensors files (no separator, no `.`/`..`, no leading dot), unique, with an xxh3_128 hex checksum;
  every tensor lies in a listed file, has a safetensors dtype, a shape of at most `MAX_NDIM` non-negative
  dimensions whose byte count equals its byte range, an aligned range inside its file's size and not
  overlapping another tensor; sharded dimensions name tensors and their dimensions; rank < world size; the
  structure has the form DCS writes (`check_structure_form`, no torch; whether its dtype and device names are
  ones torch knows is checked by `structure.check_structure` when a restore reads the manifest:
  `reader.load_manifest`); DTensor shard entries name tensors
  and lie inside their global shape (`_check_dtensors`); chunk checksums name tensors, have a bounded chunk
  size and exactly one well-formed checksum per chunk (`_check_chunks`); a file's compression is one DCS
  writes (zstd) with a `stored_size` any zstd frame of its size could have (`compression.stored_size_problem`).
- Incremental references (`FileEntry.source_step`): an integer naming an earlier step (0 <= s < this
  step); `stepcheck.check_files` then requires that step's directory to be a real directory and checks the
  referenced file there like any other.
- `check_header_entry`: one safetensors header entry's dtype, shape and byte range agree with each other and lie
  inside the file's data.
Every failure is `CorruptCheckpoint` naming the file and the reason. Since names are checked before any
path is built, nothing outside the step directory (and, for incremental references, the same run's
earlier step directories) is ever opened or stat'ed, so messages cannot reveal
anything about files elsewhere.
"""

from __future__ import annotations

import itertools
import math
import re
from collections import OrderedDict
from collections.abc import Collection, Mapping
from typing import Any

from dcs_tasks.checkpoint.format.compression import stored_size_problem
from dcs_tasks.checkpoint.format.layout import (
    CHECKSUM_ALGORITHM,
    CHUNK_ALGORITHM,
    FORMAT_VERSION,
    Manifest,
    TensorEntry,
)
from dcs_tasks.errors import CorruptCheckpoint
from dcs_tasks.storage import Location
from dcs_tasks.tensors import CODE_ITEMSIZE

MAX_MANIFEST_BYTES = 512 * 1024 * 1024
MAX_NDIM = 64
MAX_REASON = 1000  # characters of a parser's complaint kept in the message
FILE_NAME = re.compile(r"^[A-Za-z0-9_\-][A-Za-z0-9_.\-]{0,200}\.safetensors$", re.ASCII)
CHECKSUM = re.compile(r"^[0-9a-f]{32}$", re.ASCII)
CHUNK_SUM = re.compile(r"^[0-9a-f]{16}$", re.ASCII)
MIN_SUM_CHUNK = 4096  # chunk sizes accepted from a manifest: a multiple of this (every dtype stays aligned)
MAX_SUM_CHUNK = 1 << 30
MAX_PLACEMENT = 32  # characters of one recorded placement
ITEMSIZE: dict[str, int] = CODE_ITEMSIZE


def check_manifest(manifest: Manifest, path: Location) -> None:
    """Everything the manifest says about itself, checked before any of its files is touched."""
    try:
        _check_header_fields(manifest)
        sizes = _check_files(manifest)
        by_file: dict[str, list[tuple[int, int, str]]] = {name: [] for name in sizes}
        for name, entry in manifest.tensors.items():
            begin, end = check_entry(name, entry, sizes.get(entry.file))
            if end > begin:
                by_file[entry.file].append((begin, end, name))
        for ranges in by_file.values():
            _check_disjoint(ranges)
        _check_sharded_dims(manifest)
        _check_dtensors(manifest)
        _check_chunks(manifest)
        check_structure_form(manifest.structure, manifest.tensors.keys())
    except CorruptCheckpoint as exc:
        raise CorruptCheckpoint(f"{path}: {exc}", str(path)) from exc


def _check_header_fields(manifest: Manifest) -> None:
    if manifest.format_version != FORMAT_VERSION:
        raise CorruptCheckpoint(f"format version {manifest.format_version} is not {FORMAT_VERSION}")
    if manifest.rank >= manifest.world_size:
        raise CorruptCheckpoint(f"rank {manifest.rank} is not a rank of world size {manifest.world_size}")


def _check_files(manifest: Manifest) -> dict[str, int]:
    """File name -> recorded size, every entry checked."""
    sizes: dict[str, int] = {}
    for entry in manifest.files:
        if not FILE_NAME.match(entry.name) or ".." in entry.name:
            raise CorruptCheckpoint(f"file name {entry.name[:80]!r} is not a plain safetensors file name")
        if entry.name in sizes:
            raise CorruptCheckpoint(f"file {entry.name!r} is listed twice")
        if entry.algorithm != CHECKSUM_ALGORITHM or not CHECKSUM.match(entry.checksum):
            raise CorruptCheckpoint(f"file {entry.name!r} has no {CHECKSUM_ALGORITHM} checksum")
        source = entry.source_step
        if source is not None and (isinstance(source, bool) or not 0 <= source < manifest.step):
            raise CorruptCheckpoint(
                f"file {entry.name!r} refers to step {_short(source)}, not an earlier step than {manifest.step}"
            )
        problem = stored_size_problem(entry)
        if problem is not None:
            raise CorruptCheckpoint(problem)
        sizes[entry.name] = entry.size
    return sizes


def check_entry(name: str, entry: TensorEntry, file_size: int | None) -> tuple[int, int]:
    """A tensor's (begin, end), checked: known file and dtype, shape whose bytes fill the range exactly,
    range aligned to the dtype and inside the file."""
    if file_size is None:
        raise CorruptCheckpoint(f"tensor {name!r} lies in {entry.file[:80]!r}, which the manifest does not list")
    itemsize = ITEMSIZE.get(entry.dtype)
    if itemsize is None:
        raise CorruptCheckpoint(f"tensor {name!r} has dtype {entry.dtype[:32]!r}, which is not a safetensors dtype")
    nbytes = shape_bytes(entry.shape, itemsize)
    if nbytes is None:
        raise CorruptCheckpoint(f"tensor {name!r} has shape {_short(entry.shape)}, which is not a tensor shape")
    begin, end = entry.offsets
    if not 0 <= begin <= end <= file_size:
        raise CorruptCheckpoint(
            f"tensor {name!r} spans bytes {begin}..{end}, outside its file {entry.file!r} ({file_size} bytes)"
        )
    if end - begin != nbytes:
        raise CorruptCheckpoint(
            f"tensor {name!r} of shape {entry.shape} and dtype {entry.dtype} has {nbytes} bytes, "
            f"but spans {end - begin}"
        )
    if begin % itemsize:
        raise CorruptCheckpoint(f"tensor {name!r} starts at byte {begin}, not aligned to its {entry.dtype}")
    return begin, end


def shape_bytes(shape: Any, itemsize: int) -> int | None:
    """Bytes of a tensor of `shape` (None when `shape` is not a list of at most MAX_NDIM non-negative ints)."""
    if not isinstance(shape, list) or len(shape) > MAX_NDIM:
        return None
    if not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**63 for d in shape):
        return None
    return math.prod(shape) * itemsize


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check_disjoint(ranges: list[tuple[int, int, str]]) -> None:
    ranges.sort()
    for (_, end, name), (begin, _, other) in itertools.pairwise(ranges):
        if begin < end:
            raise CorruptCheckpoint(f"tensors {name!r} and {other!r} overlap in their file")


def _check_sharded_dims(manifest: Manifest) -> None:
    for name, dim in manifest.sharded_dims.items():
        entry = manifest.tensors.get(name)
        if entry is None:
            raise CorruptCheckpoint(f"sharded tensor {name[:80]!r} is not a tensor of the manifest")
        if not 0 <= dim < len(entry.shape):
            raise CorruptCheckpoint(f"sharded tensor {name!r} has no dimension {dim} (shape {entry.shape})")


def _check_dtensors(manifest: Manifest) -> None:
    """Every DTensor shard entry names a tensor of this manifest and lies inside its global shape."""
    for name, shard in (manifest.dtensors or {}).items():
        entry = manifest.tensors.get(name)
        if entry is None:
            raise CorruptCheckpoint(f"DTensor shard {name[:80]!r} is not a tensor of the manifest")
        ndim = len(entry.shape)
        if shape_bytes(shard.global_shape, 1) is None or len(shard.global_shape) != ndim:
            raise CorruptCheckpoint(f"DTensor {name!r}: global shape {_short(shard.global_shape)} is not {ndim}-D")
        if len(shard.offset) != ndim or any(
            not 0 <= o or o + n > g for o, n, g in zip(shard.offset, entry.shape, shard.global_shape, strict=True)
        ):
            raise CorruptCheckpoint(
                f"DTensor {name!r}: shard {entry.shape} at {_short(shard.offset)} lies outside {shard.global_shape}"
            )
        if shape_bytes(shard.mesh_shape, 1) is None or len(shard.placements) != len(shard.mesh_shape):
            raise CorruptCheckpoint(f"DTensor {name!r}: placements and mesh shape do not match")
        if any(not isinstance(p, str) or len(p) > MAX_PLACEMENT for p in shard.placements):
            raise CorruptCheckpoint(f"DTensor {name!r}: a placement is not a short string")


def _check_chunks(manifest: Manifest) -> None:
    """Chunk checksums: a sane chunk size, known tensors, one well-formed checksum per chunk of each."""
    chunks = manifest.chunks
    if chunks is None:
        return
    size = chunks.chunk_bytes
    if chunks.algorithm != CHUNK_ALGORITHM or size % MIN_SUM_CHUNK or not MIN_SUM_CHUNK <= size <= MAX_SUM_CHUNK:
        raise CorruptCheckpoint(f"chunk checksums: {chunks.algorithm[:32]!r} over {size}-byte chunks is not supported")
    for name, sums in chunks.sums.items():
        entry = manifest.tensors.get(name)
        if entry is None:
            raise CorruptCheckpoint(f"chunk checksums name {name[:80]!r}, which is not a tensor of the manifest")
        expected = -(-(entry.offsets[1] - entry.offsets[0]) // size)
        if len(sums) != expected or not all(isinstance(s, str) and CHUNK_SUM.match(s) for s in sums):
            raise CorruptCheckpoint(f"tensor {name!r} needs {expected} well-formed chunk checksums")


def check_header_entry(path: Location, name: str, entry: Any, data: int) -> None:
    ok = isinstance(entry, dict) and isinstance(entry.get("dtype"), str) and entry["dtype"] in ITEMSIZE
    nbytes = shape_bytes(entry.get("shape"), ITEMSIZE[entry["dtype"]]) if ok else None
    offsets = entry.get("data_offsets") if ok else None
    if (
        nbytes is None
        or not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1] <= data
        or offsets[1] - offsets[0] != nbytes
    ):
        raise CorruptCheckpoint(
            f"{path}: safetensors header entry {name[:80]!r} has no consistent dtype, shape and byte range "
            f"inside the file",
            str(path),
        )


# --- the structure: untrusted JSON that `structure.unflatten_state` rebuilds a state from -------------------

MAX_DEPTH = 200  # nesting levels accepted (a training state has a handful)
MAX_NAME = 4096  # characters of a tensor name a dtensor node may hold
_FIELDS: dict[str, frozenset[str]] = {
    "tensor": frozenset({"k", "name"}),
    "dtensor": frozenset({"k", "name"}),
    "dict": frozenset({"k", "keys", "values"}),
    "odict": frozenset({"k", "keys", "values"}),
    "list": frozenset({"k", "items"}),
    "tuple": frozenset({"k", "items"}),
    "size": frozenset({"k", "v"}),
}
_SCALAR_KINDS = frozenset({"v", "float", "dtype", "device"})


def check_structure_form(structure: Any, names: Collection[str]) -> None:
    """The form of every node of a manifest's `structure`, without torch: CorruptCheckpoint unless it is one
    `flatten_state` writes (node kinds, their fields, nesting depth, tensor names the manifest holds, plain JSON
    values, sizes, module metadata). Whether a dtype or device name is one torch knows is checked where the
    state is rebuilt (`structure.check_structure`, `unflatten_state`)."""
    StructureDecoder(dict.fromkeys(names), lenient_dtensors=True).node(structure, 0, "<root>")


def structure_error(where: str, reason: str) -> CorruptCheckpoint:
    return CorruptCheckpoint(f"structure at {where}: {reason}")


class StructureDecoder:
    """Rebuilds what a structure describes, taking tensors by name from `tensors`, and refuses any node
    `flatten_state` does not write (CorruptCheckpoint naming where). This base needs no torch: `size` nodes come
    back as lists, dtype and device values as their names; `structure._Decoder` makes the torch values."""

    def __init__(self, tensors: Mapping[str, Any], lenient_dtensors: bool = False) -> None:
        self.tensors = tensors
        self.lenient_dtensors = lenient_dtensors

    def size(self, dims: list[int]) -> Any:
        return dims

    def dtype(self, value: str, where: str) -> Any:
        return value

    def device(self, value: str) -> Any:
        return value

    def node(self, raw: Any, depth: int, where: str) -> Any:
        if depth > MAX_DEPTH:
            raise structure_error(where, f"nested deeper than {MAX_DEPTH} levels")
        kind = _kind(raw, where)
        if kind in _SCALAR_KINDS:
            return self.scalar(raw, where)
        fields = _FIELDS.get(kind)
        if fields is None:
            raise structure_error(where, f"unknown node kind {kind!r}")
        if kind in ("dict", "odict"):
            return self._mapping(raw, kind, depth, where)
        _expect_fields(raw, fields, where)
        if kind in ("tensor", "dtensor"):
            name = raw["name"]
            if isinstance(name, str) and kind == "dtensor" and self.lenient_dtensors and len(name) <= MAX_NAME:
                return self.tensors.get(name)
            if not isinstance(name, str) or name not in self.tensors:
                raise structure_error(where, f"names tensor {name!r}, which the manifest does not hold")
            return self.tensors[name]
        if kind == "size":
            return self.size(_sizes(raw["v"], where))
        items = [self.node(item, depth + 1, f"{where}/{i}") for i, item in enumerate(_list(raw["items"], where))]
        return items if kind == "list" else tuple(items)

    def _mapping(self, raw: dict[str, Any], kind: str, depth: int, where: str) -> Any:
        _expect_fields(raw, _FIELDS[kind] | ({"meta"} if "meta" in raw else set()), where)
        keys = [self.scalar(k, f"{where}/<key {i}>") for i, k in enumerate(_list(raw["keys"], where))]
        values = _list(raw["values"], where)
        if len(keys) != len(values):
            raise structure_error(where, f"{len(keys)} keys but {len(values)} values")
        pairs = [(k, self.node(v, depth + 1, f"{where}/{k}")) for k, v in zip(keys, values, strict=True)]
        meta = _module_meta(raw["meta"], where) if "meta" in raw else None
        if kind == "dict":
            return dict(pairs)
        rebuilt: OrderedDict[Any, Any] = OrderedDict(pairs)
        if meta is not None:
            rebuilt._metadata = meta  # type: ignore[attr-defined]
        return rebuilt

    def scalar(self, raw: Any, where: str) -> Any:
        kind = _kind(raw, where)
        if kind not in _SCALAR_KINDS:
            raise structure_error(where, f"{kind!r} is not a plain value")
        _expect_fields(raw, ("k", "v"), where)
        value = raw["v"]
        if kind == "v":
            if value is None or isinstance(value, bool | int | str):
                return value
            raise structure_error(
                where, f"a plain value must be null, a boolean, an integer or a string, not {type(value).__name__}"
            )
        if not isinstance(value, str):
            raise structure_error(where, f"a {kind} is written as a string, not {type(value).__name__}")
        if kind == "dtype":
            return self.dtype(value, where)
        try:
            return float.fromhex(value) if kind == "float" else self.device(value)
        except (ValueError, RuntimeError, OverflowError) as exc:
            raise structure_error(where, f"{value[:64]!r} is not a valid {kind}") from exc


def _kind(raw: Any, where: str) -> str:
    if not isinstance(raw, dict):
        raise structure_error(where, f"a node must be a JSON object, not {type(raw).__name__}")
    kind = raw.get("k")
    if not isinstance(kind, str):
        raise structure_error(where, "node has no kind")
    return kind


def _expect_fields(raw: dict[str, Any], fields: Collection[str], where: str) -> None:
    if set(raw) != set(fields):
        raise structure_error(where, f"{raw['k']!r} node has fields {sorted(raw)}, expected {sorted(fields)}")


def _list(raw: Any, where: str) -> list[Any]:
    if not isinstance(raw, list):
        raise structure_error(where, f"expected a JSON list, not {type(raw).__name__}")
    return raw


def _sizes(raw: Any, where: str) -> list[int]:
    dims = _list(raw, where)
    if not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**63 for d in dims):
        raise structure_error(where, "a size must be a list of non-negative integers")
    return dims


def _module_meta(raw: Any, where: str) -> OrderedDict[str, dict[str, Any]]:
    """`state_dict()._metadata`: {module prefix: {str: None/bool/int/str}}."""
    if not isinstance(raw, dict) or not all(isinstance(entry, dict) for entry in raw.values()):
        raise structure_error(where, "module metadata must map prefixes to JSON objects")
    for entry in raw.values():
        if not all(v is None or isinstance(v, bool | int | str) for v in entry.values()):
            raise structure_error(where, "module metadata values must be null, booleans, integers or strings")
    return OrderedDict((prefix, dict(entry)) for prefix, entry in raw.items())
