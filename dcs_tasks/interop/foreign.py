"""Read checkpoints written by other tools, as untrusted input: a Hugging Face directory or a torch DCP one.

Hugging Face (`model.safetensors`, or `model.safetensors.index.json` and the shards it names): the index is a
regular file of at most `MAX_INDEX_BYTES` holding a JSON object whose `weight_map` maps tensor names to plain
safetensors file names in the directory; every file is opened without following symlinks, and its header is
checked like a DCS file's (`stepcheck.read_header`: length bounded by the file and 100 MiB, every entry's dtype,
shape and byte range consistent and inside the data) before any data byte is read. The index and the headers
must agree on which file holds which tensor.

torch DCP (`.metadata` + `*.distcp`): the metadata is a pickle, so it is never given to `pickle.load`
(torch's own `FileSystemReader.read_metadata` does that, and its `DefaultLoadPlanner.load_bytes` calls
`torch.load(weights_only=False)`: either would run code from a crafted checkpoint). It is read with an
unpickler that resolves only the DCP metadata classes, `torch.Size`, torch dtypes, layouts and memory formats
(anything else is refused by name), at most `MAX_METADATA_BYTES`, and then checked: storage files are plain
names in the directory, byte ranges lie inside them, stream transforms (compression) are refused, each
tensor's chunks tile it exactly, and the tensors' bytes fit in the files (so a small metadata file cannot make
this allocate more than the checkpoint holds). Tensors are then read by torch's own `dcp.load` (which decodes
each chunk with `torch.load(weights_only=True)`) into a template built from the checked metadata; non-tensor
values are decoded with `torch.load(weights_only=True)` (plain Python values only), at most
`MAX_BYTES_ITEM` each.
"""

from __future__ import annotations

import io
import json
import math
import mmap
import os
import pickle
import re
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy
import torch

from dcs_tasks.checkpoint.format.layout import CODE_DTYPES, DTYPE_CODES
from dcs_tasks.checkpoint.format.validate import MAX_NDIM
from dcs_tasks.checkpoint.store.reads.stepcheck import read_header, read_small
from dcs_tasks.errors import CheckpointError, CorruptCheckpoint
from dcs_tasks.storage.fs import open_regular

HF_SINGLE = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
DCP_METADATA = ".metadata"
MAX_INDEX_BYTES = 64 * 1024 * 1024
MAX_METADATA_BYTES = 256 * 1024 * 1024
MAX_BYTES_ITEM = 64 * 1024 * 1024
MAX_TENSORS = 1_000_000
MAX_CHUNKS = 4096  # per tensor
MAX_TILING_CELLS = 1 << 22  # grid cells the chunk edges of one tensor may cut it into (a grid of chunks: one each)
MAX_PATH_DEPTH = 64
SAFE_FILE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,200}$", re.ASCII)


class ForeignCheckpointError(CheckpointError):
    """A checkpoint written by another tool (Hugging Face, torch DCP) cannot be imported: missing, malformed,
    inconsistent, or using a feature DCS does not read. The message names the file and the reason."""


# --- Hugging Face -------------------------------------------------------------------------------------------


def read_hf_dir(directory: Path) -> OrderedDict[str, torch.Tensor]:
    """name -> tensor of a Hugging Face directory (index order, else header order). Tensors are copy-on-write
    views of read-only file mappings: the files are read as the tensors are copied, never written."""
    files = _hf_files(directory)
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    for name, expected in files.items():
        for tensor_name, tensor in _read_safetensors(directory / name).items():
            if expected is not None and tensor_name not in expected:
                raise ForeignCheckpointError(f"{directory / name} holds {tensor_name!r}, which {HF_INDEX} does not map")
            if tensor_name in out:
                raise ForeignCheckpointError(f"tensor {tensor_name!r} is in two files of {directory}")
            out[tensor_name] = tensor
    missing = [n for names in files.values() if names is not None for n in names if n not in out]
    if missing:
        raise ForeignCheckpointError(f"{HF_INDEX} of {directory} maps {missing[0]!r}, which its file does not hold")
    return out


def _hf_files(directory: Path) -> dict[str, set[str] | None]:
    """file name -> the tensor names the index puts there (None: no index, the single file)."""
    if not directory.is_dir():
        raise ForeignCheckpointError(f"{directory} is not a directory")
    index = directory / HF_INDEX
    if not os.path.lexists(index):
        if not os.path.lexists(directory / HF_SINGLE):
            raise ForeignCheckpointError(f"{directory} holds neither {HF_SINGLE} nor {HF_INDEX}")
        return {HF_SINGLE: None}
    parsed = _json_file(index, MAX_INDEX_BYTES)
    weight_map = parsed.get("weight_map") if isinstance(parsed, dict) else None
    if not isinstance(weight_map, dict) or not weight_map or len(weight_map) > MAX_TENSORS:
        raise ForeignCheckpointError(f"{index} has no weight_map of tensor names to files")
    files: dict[str, set[str] | None] = {}
    for tensor_name, file_name in weight_map.items():
        if not isinstance(file_name, str) or not _safe_name(file_name) or not file_name.endswith(".safetensors"):
            raise ForeignCheckpointError(
                f"{index} maps {tensor_name[:80]!r} to {str(file_name)[:80]!r}, not a file here"
            )
        names = files.setdefault(file_name, set())
        assert names is not None
        names.add(tensor_name)
    return dict(sorted(files.items()))


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    fd = _open(path)
    try:
        size = os.fstat(fd).st_size
        header, start = _checked(lambda: read_header(fd, path, size))
        entries = {k: v for k, v in header.items() if k != "__metadata__"}
        mapping = mmap.mmap(fd, size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE) if size else None
    finally:
        os.close(fd)
    out: dict[str, torch.Tensor] = {}
    for name, entry in entries.items():
        dtype = CODE_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ForeignCheckpointError(f"{path}: tensor {name!r} has dtype {entry['dtype']}, which DCS cannot store")
        begin, end = entry["data_offsets"]
        if end == begin:
            out[name] = torch.empty(entry["shape"], dtype=dtype)
        else:
            assert mapping is not None
            out[name] = torch.frombuffer(
                mapping, dtype=dtype, count=(end - begin) // dtype.itemsize, offset=start + begin
            )
            out[name] = out[name].view(entry["shape"])
    return out


# --- torch DCP ------------------------------------------------------------------------------------------------


_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the classes DCP metadata is made of (plus torch dtypes); anything else is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name in _DCP_CLASSES.get(module, ()):
            return super().find_class(module, name)
        raise ForeignCheckpointError(f"DCP metadata refers to {module[:80]}.{name[:80]}, which is not DCP metadata")


def read_dcp_dir(directory: Path) -> dict[str, Any]:
    """The state a DCP checkpoint holds, nested as it was saved (DCP's `planner_data`), tensors on the CPU."""
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    metadata = read_dcp_metadata(directory)
    template: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if _is_tensor_md(md):
            template[fqn] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    if template:
        with warnings.catch_warnings():  # "torch.distributed is disabled ...": one process reads, as intended
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            reader = _checked_reader(directory, metadata)
            load(template, storage_reader=reader, planner=DefaultLoadPlanner(), no_dist=True)
    values = {k.fqn: v for k, v in metadata.storage_data.items() if k.offset is None}
    for fqn, md in metadata.state_dict_metadata.items():
        if not _is_tensor_md(md):
            template[fqn] = _load_bytes_item(directory, values[fqn], fqn)
    return _nest(template, metadata.planner_data, directory)


def read_dcp_metadata(directory: Path) -> Any:
    """DCP's `Metadata` of `directory`, unpickled with `_MetadataUnpickler` and checked (`_check_metadata`)."""
    if not directory.is_dir():
        raise ForeignCheckpointError(f"{directory} is not a directory")
    path = directory / DCP_METADATA
    raw = _checked(lambda: read_small(path, MAX_METADATA_BYTES))
    try:
        metadata = _MetadataUnpickler(io.BytesIO(raw)).load()
    except ForeignCheckpointError:
        raise
    except Exception as exc:  # any malformed pickle: UnpicklingError, EOFError, TypeError, RecursionError ...
        raise ForeignCheckpointError(f"{path} is not DCP metadata: {type(exc).__name__}: {str(exc)[:200]}") from exc
    _check_metadata(metadata, directory)
    return metadata


def _check_metadata(metadata: Any, directory: Path) -> None:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

    path = directory / DCP_METADATA
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise ForeignCheckpointError(f"{path} does not hold DCP Metadata")
    if len(metadata.state_dict_metadata) > MAX_TENSORS or not isinstance(metadata.storage_data, dict):
        raise ForeignCheckpointError(f"{path}: too many entries or no storage index")
    storage = _check_storage(metadata.storage_data, directory)
    data_bytes = 0
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(fqn, str):
            raise ForeignCheckpointError(f"{path}: a key is not a string")
        if isinstance(md, BytesStorageMetadata):
            if (fqn, None) not in storage:
                raise ForeignCheckpointError(f"{path}: value {fqn!r} has no stored bytes")
            continue
        data_bytes += _check_tensor_md(fqn, md, storage, path)
    files = {info.relative_path for info in metadata.storage_data.values()}
    if data_bytes > sum(_file_size(directory / name) for name in files):
        raise ForeignCheckpointError(f"{path}: its tensors hold more bytes than its files")


def _check_storage(storage_data: dict[Any, Any], directory: Path) -> set[tuple[str, tuple[int, ...] | None]]:
    """(fqn, chunk offset) of every stored item; each item's file and byte range checked."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex

    sizes: dict[str, int] = {}
    found: set[tuple[str, tuple[int, ...] | None]] = set()
    for index, info in storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise ForeignCheckpointError(f"{directory / DCP_METADATA}: malformed storage index")
        name = info.relative_path
        if not isinstance(name, str) or not _safe_name(name):
            raise ForeignCheckpointError(f"{directory / DCP_METADATA} names file {str(name)[:80]!r}, not a file here")
        if info.transform_descriptors:
            raise ForeignCheckpointError(f"{directory / name}: transformed (e.g. compressed) items are not supported")
        if name not in sizes:
            sizes[name] = _file_size(directory / name)
        if not (_int(info.offset) and _int(info.length) and info.offset + info.length <= sizes[name]):
            raise ForeignCheckpointError(f"{directory / DCP_METADATA}: an item of {name} lies outside the file")
        offset = None if index.offset is None else tuple(int(i) for i in index.offset)
        found.add((str(index.fqn), offset))
    return found


def _check_tensor_md(fqn: str, md: Any, storage: set[tuple[str, tuple[int, ...] | None]], path: Path) -> int:
    """The tensor's bytes, after checking its dtype, size and that its chunks tile it and are all stored."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata

    if not isinstance(md, TensorStorageMetadata) or md.properties.dtype not in DTYPE_CODES:
        raise ForeignCheckpointError(f"{path}: {fqn!r} is neither bytes nor a tensor of a safetensors dtype")
    size = _dims(md.size)
    chunks = md.chunks
    if size is None or not isinstance(chunks, list) or len(chunks) > MAX_CHUNKS:
        raise ForeignCheckpointError(f"{path}: tensor {fqn!r} has a malformed size or chunk list")
    boxes = []
    for chunk in chunks:
        offsets, sizes = (
            (_dims(chunk.offsets), _dims(chunk.sizes)) if isinstance(chunk, ChunkStorageMetadata) else (None, None)
        )
        if offsets is None or sizes is None or len(offsets) != len(size) or len(sizes) != len(size):
            raise ForeignCheckpointError(f"{path}: tensor {fqn!r} has a malformed chunk")
        if any(o + s > d for o, s, d in zip(offsets, sizes, size, strict=True)):
            raise ForeignCheckpointError(f"{path}: a chunk of tensor {fqn!r} lies outside it")
        if (fqn, tuple(offsets)) not in storage:
            raise ForeignCheckpointError(f"{path}: a chunk of tensor {fqn!r} has no stored bytes")
        boxes.append((offsets, sizes))
    _check_tiling(fqn, size, boxes, path)
    return math.prod(size) * md.properties.dtype.itemsize


def _check_tiling(fqn: str, size: list[int], boxes: list[tuple[list[int], list[int]]], path: Path) -> None:
    """The chunks cover the tensor exactly once: their volumes add up to it and no two overlap.

    Linear in the chunks plus the cells of the grid their edges cut the tensor into (a pairwise test was
    quadratic: 4096 chunks of one tensor cost 16.8 CPU-s): the distinct chunk edges are sorted per dimension,
    each chunk marks the block of grid cells it spans, and a cell marked twice is an overlap. DCP's chunks
    are the saving ranks' shards, a grid, so there are as many cells as chunks; a layout whose edges cut the
    tensor into more than `MAX_TILING_CELLS` cells is refused as too irregular to check."""
    if sum(math.prod(s) for _, s in boxes) != math.prod(size):
        raise ForeignCheckpointError(f"{path}: the chunks of tensor {fqn!r} do not cover it exactly")
    nonempty = [b for b in boxes if math.prod(b[1])]
    if len(nonempty) < 2:
        return
    edges = [sorted({o[k] for o, _ in nonempty} | {o[k] + s[k] for o, s in nonempty}) for k in range(len(size))]
    cells = math.prod(len(e) - 1 for e in edges)
    if cells > MAX_TILING_CELLS:
        raise ForeignCheckpointError(
            f"{path}: the chunks of tensor {fqn!r} cut it into {cells} pieces, more than {MAX_TILING_CELLS}: "
            "too irregular a layout to check"
        )
    position = [{edge: i for i, edge in enumerate(e)} for e in edges]
    marked = numpy.zeros([len(e) - 1 for e in edges], dtype=numpy.bool_)
    for offsets, sizes in nonempty:
        block = marked[tuple(slice(at[o], at[o + n]) for at, o, n in zip(position, offsets, sizes, strict=True))]
        if block.any():
            raise ForeignCheckpointError(f"{path}: two chunks of tensor {fqn!r} overlap")
        block[...] = True


def _is_tensor_md(md: Any) -> bool:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return isinstance(md, TensorStorageMetadata)


def _checked_reader(directory: Path, metadata: Any) -> Any:
    """torch's `FileSystemReader` answering with the checked metadata instead of unpickling the file itself."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class CheckedReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return CheckedReader(str(directory))


def _load_bytes_item(directory: Path, info: Any, fqn: str) -> Any:
    """A non-tensor value: torch.load(weights_only=True) of its stored bytes (plain Python values only)."""
    if info.length > MAX_BYTES_ITEM:
        raise ForeignCheckpointError(f"value {fqn!r} has {info.length} bytes, more than {MAX_BYTES_ITEM}")
    path = directory / info.relative_path
    fd = _open(path)
    try:
        raw = os.pread(fd, info.length, info.offset)
    finally:
        os.close(fd)
    try:
        return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as exc:  # UnpicklingError for anything but plain values, or a malformed item
        raise ForeignCheckpointError(f"value {fqn!r} in {path} cannot be read safely: {str(exc)[:300]}") from exc


def _nest(flat: dict[str, Any], planner_data: Any, directory: Path) -> dict[str, Any]:
    """DCP's flat keys back into the nested state (`planner_data`: key -> path tuple, an int part being a list
    index, as DCP's own `set_element` reads it); flat when absent."""
    if not isinstance(planner_data, dict) or not all(k in planner_data for k in flat):
        return flat
    where = directory / DCP_METADATA
    root: dict[Any, Any] = {}
    for key, value in flat.items():
        path = planner_data[key]
        if not isinstance(path, tuple) or not 0 < len(path) <= MAX_PATH_DEPTH:
            raise ForeignCheckpointError(f"{where}: malformed path for {key[:80]!r}")
        if not all(isinstance(part, str) or _int(part) for part in path):
            raise ForeignCheckpointError(f"{where}: the path of {key[:80]!r} holds something but keys and indices")
        node = root
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ForeignCheckpointError(f"{where}: {key[:80]!r} nests inside a value")
        if path[-1] in node:
            raise ForeignCheckpointError(f"{where}: two values at the path of {key[:80]!r}")
        node[path[-1]] = value
    rebuilt = _lists(root, 0)
    assert isinstance(rebuilt, dict)
    return rebuilt


def _lists(node: Any, depth: int) -> Any:
    """Containers keyed 0..n-1 by list indices become lists again; others stay dicts."""
    if not isinstance(node, dict) or depth > MAX_PATH_DEPTH:
        return node
    items = {k: _lists(v, depth + 1) for k, v in node.items()}
    if depth > 0 and items and all(isinstance(k, int) for k in items) and sorted(items) == list(range(len(items))):
        return [items[i] for i in range(len(items))]
    return {str(k): v for k, v in items.items()}


# --- shared -------------------------------------------------------------------------------------------------


def _safe_name(name: str) -> bool:
    return bool(SAFE_FILE.match(name)) and ".." not in name


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _dims(value: Any) -> list[int] | None:
    if not isinstance(value, tuple | list) or len(value) > MAX_NDIM or not all(_int(d) for d in value):
        return None
    return [int(d) for d in value]


def _checked(call: Any) -> Any:
    """`call()`, with the product's CorruptCheckpoint (its checks name the file) as ForeignCheckpointError."""
    try:
        return call()
    except CorruptCheckpoint as exc:
        raise ForeignCheckpointError(str(exc)) from exc


def _open(path: Path) -> int:
    return int(_checked(lambda: open_regular(path)))


def _file_size(path: Path) -> int:
    fd = _open(path)
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def _json_file(path: Path, limit: int) -> Any:
    raw = _checked(lambda: read_small(path, limit))
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ForeignCheckpointError(f"{path} is not JSON: {str(exc)[:200]}") from exc


__all__ = ["ForeignCheckpointError", "read_dcp_dir", "read_dcp_metadata", "read_hf_dir"]
