"""Checks of committed steps read back from disk: manifests and safetensors files are untrusted input.

Anyone who can write into the checkpoint directory can hand restore a crafted step, so nothing in it is
believed before it is checked, and everything is checked before memory is allocated or a data file is read:
- `read_manifest`: `manifest.json` is a regular file (not a symlink) of bounded size that parses as a
  `Manifest`, `check_manifest` holds, and a step directory named as DCS names it holds that step's manifest.
- `check_manifest` (no file I/O): the format version is known; file names are plain basenames of
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
  step); `check_files` requires that step's directory to be a real directory (lstat: not a symlink) and
  checks the referenced file there like any other, so a missing one is `CorruptCheckpoint` naming it.
- `check_files`: each listed file is a regular file in the step directory (lstat, opened with O_NOFOLLOW:
  a symlink is refused, never followed) of exactly its recorded size, and its safetensors header (length
  bounded by the file and `MAX_HEADER_BYTES`, valid JSON, every entry's dtype, shape and byte range
  consistent and inside the file) lists exactly the manifest's tensors of that file at the same places.
  Costs one open and one small header read per file: no data bytes are read. A compressed file must have
  its `stored_size`, a zstd frame header recording exactly its `size`, and its header is read by
  decompressing only the header's bytes (`compression.Decoder`).
Every failure is `CorruptCheckpoint` naming the file and the reason. Since names are checked before any
path is built, nothing outside the step directory (and, for incremental references, the same run's
earlier step directories) is ever opened or stat'ed, so messages cannot reveal
anything about files elsewhere.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import re
import stat
import struct
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path
from typing import Any

from dcs_tasks.checkpoint.format.compression import Decoder, check_frame, stored_size_problem
from dcs_tasks.checkpoint.format.layout import (
    CHECKSUM_ALGORITHM,
    CHUNK_ALGORITHM,
    FORMAT_VERSION,
    MANIFEST_NAME,
    STEP_DIR,
    FileEntry,
    Manifest,
    TensorEntry,
)
from dcs_tasks.errors import CorruptCheckpoint
from dcs_tasks.storage import Location, ObjectPath, store_of
from dcs_tasks.storage.factory import is_object
from dcs_tasks.storage.fs import open_regular
from dcs_tasks.storage.objpath import listed_sizes
from dcs_tasks.storage.s3 import ObjectMissing
from dcs_tasks.tensors import CODE_ITEMSIZE

MAX_MANIFEST_BYTES = 512 * 1024 * 1024
HEAD_PREFETCH = 256 * 1024  # bytes of an object fetched at once for its safetensors header
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the limit safetensors itself applies
MAX_NDIM = 64
MAX_REASON = 1000  # characters of a parser's complaint kept in the message
FILE_NAME = re.compile(r"^[A-Za-z0-9_\-][A-Za-z0-9_.\-]{0,200}\.safetensors$", re.ASCII)
CHECKSUM = re.compile(r"^[0-9a-f]{32}$", re.ASCII)
CHUNK_SUM = re.compile(r"^[0-9a-f]{16}$", re.ASCII)
MIN_SUM_CHUNK = 4096  # chunk sizes accepted from a manifest: a multiple of this (every dtype stays aligned)
MAX_SUM_CHUNK = 1 << 30
MAX_PLACEMENT = 32  # characters of one recorded placement
ITEMSIZE: dict[str, int] = CODE_ITEMSIZE


def read_manifest(step_dir: Location) -> Manifest:
    """`step_dir`'s manifest, parsed and checked (`check_manifest`); CorruptCheckpoint names what is wrong."""
    path = step_dir / MANIFEST_NAME
    raw = read_small(path, MAX_MANIFEST_BYTES)
    try:
        manifest = Manifest.model_validate_json(raw)
    except ValueError as exc:
        reason = str(exc)
        reason = reason if len(reason) <= MAX_REASON else reason[: MAX_REASON - 3] + "..."
        raise CorruptCheckpoint(f"{path} is unreadable: {reason}", str(path)) from exc
    check_manifest(manifest, path)
    match = STEP_DIR.match(step_dir.name)
    if match and int(match.group(1)) != manifest.step:
        raise CorruptCheckpoint(f"{path}: records step {manifest.step}, not {int(match.group(1))}", str(path))
    return manifest


def read_small(path: Location, limit: int) -> bytes:
    """The bytes of a regular file (not a symlink) of at most `limit` bytes; CorruptCheckpoint otherwise. An
    object (`ObjectPath`): at most `limit` + 1 bytes are fetched."""
    return store_of(path).read_small(path, limit)


@contextlib.contextmanager
def _reading(path: Path) -> Iterator[None]:
    """An I/O error while reading a checkpoint file makes the step unusable, like a bad checksum."""
    try:
        yield
    except OSError as exc:
        raise CorruptCheckpoint(f"checkpoint file {path} cannot be read: {exc.strerror}", str(path)) from exc


def open_stored(path: Path, entry: FileEntry) -> int:
    """`open_regular(path)`, which must have the entry's `disk_size` bytes (CorruptCheckpoint otherwise)."""
    fd = open_regular(path)
    size = os.fstat(fd).st_size
    if size != entry.disk_size:
        os.close(fd)
        raise CorruptCheckpoint(f"checkpoint file {path} has {size} bytes, manifest says {entry.disk_size}", str(path))
    return fd


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


def check_files(step_dir: Location, manifest: Manifest) -> None:
    """Each file of `manifest` (already checked) against the disk: a regular file of its recorded size whose
    safetensors header agrees with the manifest. Reads only the headers."""
    by_file: dict[str, dict[str, TensorEntry]] = {f.name: {} for f in manifest.files}
    for name, entry in manifest.tensors.items():
        by_file[entry.file][name] = entry
    if is_object(step_dir):  # no descriptor to check through: sizes from one listing, headers by ranged reads
        _check_objects(step_dir, manifest, by_file)
        return
    for f in manifest.files:
        path = f.stored_path(step_dir)
        if f.source_step is not None:
            _check_source_dir(path.parent, f.name, f.source_step)
        fd = open_stored(path, f)
        size = f.disk_size
        try:
            with _reading(path):
                if f.compression:
                    check_frame(fd, path, f)
                    _check_header(fd, path, f.size, by_file[f.name], Decoder(fd, path, f).read)
                else:
                    _check_header(fd, path, size, by_file[f.name])
        finally:
            os.close(fd)


def _check_objects(step_dir: ObjectPath, manifest: Manifest, by_file: dict[str, dict[str, TensorEntry]]) -> None:
    """`check_files` for a step in an object store: each object exists with its recorded size and, stored plain,
    its safetensors header (read with ranged GETs) agrees with the manifest. A compressed object's frame and
    header are checked when it is read (fetched whole, then decompressed: `objread`)."""
    listed = listed_sizes([f.stored_path(step_dir) for f in manifest.files])
    for f in manifest.files:
        path = f.stored_path(step_dir)
        size = listed.get(path.key)
        if size is None:
            raise CorruptCheckpoint(f"checkpoint object {path} is missing", str(path))
        if size != f.disk_size:
            raise CorruptCheckpoint(
                f"checkpoint object {path} has {size} bytes, manifest says {f.disk_size}", str(path)
            )
        if not f.compression:
            _check_header(-1, path, size, by_file[f.name], _object_reader(path, size))


def _object_reader(path: ObjectPath, size: int) -> Callable[[int], bytes]:
    """`read(n)`: the object's next n bytes from its start. The first `HEAD_PREFETCH` bytes come with one ranged
    GET (a header is almost always shorter), the rest, if a header is longer, with one more."""
    pos = 0
    first = bytearray(min(size, HEAD_PREFETCH))
    fetched = False

    def read(n: int) -> bytes:
        nonlocal pos, fetched
        n = max(0, min(n, size - pos))
        try:
            if not fetched and first:
                path.store.read_into(path.key, 0, [memoryview(first)])
                fetched = True
            if pos + n <= len(first):
                out = bytes(first[pos : pos + n])
            else:
                buf = bytearray(n)
                if n:
                    path.store.read_into(path.key, pos, [memoryview(buf)])
                out = bytes(buf)
        except ObjectMissing as exc:
            raise CorruptCheckpoint(f"checkpoint object {path} is missing", str(path)) from exc
        pos += n
        return out

    return read


def _check_source_dir(source_dir: Path, name: str, step: int) -> None:
    """An incremental reference's step directory is a real directory (a symlink is never followed)."""
    try:
        found = source_dir.lstat()
    except OSError:
        found = None
    if found is None or not stat.S_ISDIR(found.st_mode):
        why = "does not exist" if found is None else "is not a directory (symlinks are never followed)"
        raise CorruptCheckpoint(
            f"file {name!r} refers to step {step}, whose directory {source_dir} {why}", str(source_dir)
        )


def _check_header(
    fd: int, path: Location, size: int, expected: Mapping[str, TensorEntry], read: Callable[[int], bytes] | None = None
) -> None:
    header, start = read_header(fd, path, size, read)
    names = set(header) - {"__metadata__"}
    if names != set(expected):
        odd = sorted(names ^ set(expected))[0]
        raise CorruptCheckpoint(f"safetensors header of {path} and the manifest disagree on tensor {odd[:80]!r}")
    for name, entry in expected.items():
        got = header[name]
        if (
            not isinstance(got, dict)
            or got.get("dtype") != entry.dtype
            or got.get("shape") != entry.shape
            or got.get("data_offsets") != [entry.offsets[0] - start, entry.offsets[1] - start]
        ):
            raise CorruptCheckpoint(f"safetensors header of {path} and the manifest disagree on tensor {name!r}")


def read_header(
    fd: int, path: Location, size: int, read: Callable[[int], bytes] | None = None
) -> tuple[dict[str, Any], int]:
    """The parsed safetensors header of an open file of `size` bytes and where its data starts; every
    entry's dtype, shape and byte range checked against each other and the file. `read(n)`: the file's
    next n bytes from its start (a compressed file's `Decoder`); default: `pread` of `fd`."""
    if read is None:
        read = _sequential_pread(fd)
    prefix = read(8) if size >= 8 else b""
    if len(prefix) != 8:
        raise CorruptCheckpoint(f"{path} is too short for a safetensors header", str(path))
    (length,) = struct.unpack("<Q", prefix)
    if length > min(size - 8, MAX_HEADER_BYTES):
        raise CorruptCheckpoint(f"{path}: safetensors header length {length} exceeds the file", str(path))
    raw = read(length)
    try:
        header = json.loads(raw) if len(raw) == length else None
    except (ValueError, RecursionError):
        header = None  # UnicodeDecodeError, JSONDecodeError, absurd nesting
    if not isinstance(header, dict):
        raise CorruptCheckpoint(f"{path}: safetensors header is not a JSON object", str(path))
    data = size - 8 - length
    for name, entry in header.items():
        if name != "__metadata__":
            _check_header_entry(path, name, entry, data)
    return header, 8 + length


def _sequential_pread(fd: int) -> Callable[[int], bytes]:
    pos = [0]

    def read(n: int) -> bytes:
        data = os.pread(fd, n, pos[0])
        pos[0] += len(data)
        return data

    return read


def _check_header_entry(path: Location, name: str, entry: Any, data: int) -> None:
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
