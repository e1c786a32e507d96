"""On-disk format: safetensors files laid out ahead of time, the manifest, and file checksums.

A step directory `{checkpoint_dir}/{run}/step-{step:09d}/` holds `model-0000i-of-0000n.safetensors`
files and `manifest.json`; `{checkpoint_dir}/{run}/latest` names the newest committed step. The staging
buffer already holds the exact bytes of every file (8-byte header length, JSON header, tensor data), so
persisting is a byte stream. Tensors are ordered by decreasing element size, which keeps every tensor
aligned to its dtype inside the file (views over the bytes need no copy); the header is padded with
spaces (as safetensors itself does) so that data starts on a 64-byte boundary.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import platform
import re
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

import xxhash
from pydantic import BaseModel, ConfigDict, Field

# The dtype table and the tensor description are shared with weight sync (dcs_tasks.tensors); the checkpoint
# readers import the code <-> dtype maps from here (built on first use: a worker moving bytes never imports torch).
from dcs_tasks import tensors as _tensors
from dcs_tasks.checkpoint.format import nogil
from dcs_tasks.storage.objpath import ObjectPath
from dcs_tasks.tensors import TensorSpec as TensorSpec
from dcs_tasks.tensors import specs_of as specs_of


def __getattr__(name: str) -> Any:
    if name in ("CODE_DTYPES", "DTYPE_CODES"):
        return getattr(_tensors, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
LATEST_NAME = "latest"
CHECKSUM_ALGORITHM = "xxh3_128"
CHUNK_ALGORITHM = "xxh3_64"
SUM_CHUNK_BYTES = 256 * 1024  # granularity of the per-tensor chunk checksums that partial reads verify
DATA_ALIGN = 64
REGION_ALIGN = 4096


def step_dir_name(step: int) -> str:
    return f"step-{step:09d}"


STEP_DIR = re.compile(r"^step-(\d{9,})$", re.ASCII)  # names `step_dir_name` writes (and longer steps)
RANK_DIR = re.compile(r"^rank-(\d{5})$")  # one rank's directory of a multi-rank run (`rank_dir_name`)


def rank_dir_name(rank: int) -> str:
    return f"rank-{rank:05d}"


def shard_run_name(run: str, rank: int) -> str:
    """The ledger and staging name of one rank's shard of `run`."""
    return f"{run}.{rank_dir_name(rank)}"


def file_name(index: int, count: int) -> str:
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def chunk_sum(data: Any) -> str:
    """The checksum of one `SUM_CHUNK_BYTES` piece of a tensor's bytes (xxh3_64, hex)."""
    return str(xxhash.xxh3_64_hexdigest(data))


def new_hasher() -> Any:
    """The streaming checksum used for every file (xxh3_128: >10 GB/s, so it hides behind the I/O), hashing
    without the GIL where the xxhash build allows (`nogil.Hasher`: the same digests)."""
    return nogil.Hasher() if nogil.available() else xxhash.xxh3_128()


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor lives: its file and its byte range relative to that file's data section."""

    spec: TensorSpec
    file_index: int
    begin: int
    end: int


@dataclass(frozen=True)
class FileLayout:
    """One safetensors file: its name, header bytes and the staging region `[offset, offset+size)`."""

    name: str
    header: bytes
    slots: tuple[TensorSlot, ...]
    offset: int
    size: int

    @property
    def data_start(self) -> int:
        return len(self.header)


@dataclass(frozen=True)
class Layout:
    """The complete byte layout of a state: every file, in staging order. `nbytes` = staging size needed."""

    files: tuple[FileLayout, ...]
    signature: str

    @property
    def nbytes(self) -> int:
        last = self.files[-1]
        return last.offset + last.size

    @property
    def data_bytes(self) -> int:
        return sum(f.size for f in self.files)


def _header_bytes(slots: list[TensorSlot]) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "writer": "dcs"}}
    for slot in slots:
        header[slot.spec.name] = {
            "dtype": slot.spec.code,
            "shape": list(slot.spec.shape),
            "data_offsets": [slot.begin, slot.end],
        }
    raw = json.dumps(header, separators=(",", ":")).encode()
    padded = -(-(8 + len(raw)) // DATA_ALIGN) * DATA_ALIGN - 8
    return struct.pack("<Q", padded) + raw + b" " * (padded - len(raw))


def _group(specs: list[TensorSpec], shard_bytes: int) -> list[list[TensorSpec]]:
    groups: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if groups[-1] and size + spec.nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(spec)
        size += spec.nbytes
    return groups


def plan_layout(specs: list[TensorSpec], shard_bytes: int, apart: frozenset[str] = frozenset()) -> Layout:
    """Assign tensors to files of at most `shard_bytes` of data (a bigger tensor gets a file of its own). The
    layout's specs are spelled in safetensors codes; UnsupportedDtype names a tensor a checkpoint cannot store.
    Tensors named in `apart` (those seen changing between saves) go after the others, in files of their own,
    so that files of unchanged tensors keep equal bytes from save to save (incremental saves reuse them)."""
    checked = [spec.checkpoint() for spec in specs]
    parts = ([s for s in checked if s.name not in apart], [s for s in checked if s.name in apart])
    groups = [g for part in parts for g in _group(sorted(part, key=lambda s: -s.itemsize), shard_bytes) if g] or [[]]
    files: list[FileLayout] = []
    offset = 0
    for index, group in enumerate(groups):
        slots, pos = [], 0
        for spec in group:
            slots.append(TensorSlot(spec, index, pos, pos + spec.nbytes))
            pos += spec.nbytes
        header = _header_bytes(slots)
        size = len(header) + pos
        files.append(FileLayout(file_name(index, len(groups)), header, tuple(slots), offset, size))
        offset += -(-size // REGION_ALIGN) * REGION_ALIGN
    digest = hashlib.sha256(b"".join(f.header for f in files)).hexdigest()[:32]
    return Layout(files=tuple(files), signature=digest)


COMPRESSED_SUFFIX = {"zstd": ".zst"}  # codec -> suffix of a compressed file's on-disk name


class FileEntry(BaseModel):
    """One file of a step. `size` and `checksum` are those of the safetensors bytes; a compressed file
    (`compression`, see `dcs_tasks.checkpoint.format.compression`) holds `stored_size` bytes on disk under
    `name` + its codec's suffix."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    size: int = Field(ge=0)
    checksum: str
    algorithm: str = CHECKSUM_ALGORITHM
    # incremental saves: the bytes were equal to those of an earlier step's same-named file, which holds
    # them (always the step that physically holds the bytes, never a chain); None: in this step's directory
    source_step: int | None = None
    # absent (None) for files stored as they are, and in manifests written before compression existed
    compression: str | None = None
    stored_size: int | None = Field(default=None, ge=0)

    @property
    def stored_name(self) -> str:
        return self.name + COMPRESSED_SUFFIX.get(self.compression or "", "")

    @property
    def disk_size(self) -> int:
        """Bytes of the file on disk: `stored_size` when compressed, else `size`."""
        return self.stored_size if self.compression and self.stored_size is not None else self.size

    @overload
    def stored_path(self, step_dir: Path) -> Path: ...
    @overload
    def stored_path(self, step_dir: ObjectPath) -> ObjectPath: ...
    @overload
    def stored_path(self, step_dir: Path | ObjectPath) -> Path | ObjectPath: ...
    def stored_path(self, step_dir: Path | ObjectPath) -> Path | ObjectPath:
        """Where this file's bytes lie on disk for the step at `step_dir`. Every reader resolves a file
        through here, so a format change of where or how bytes are stored changes this one place."""
        if self.source_step is not None:
            return step_dir.parent / step_dir_name(self.source_step) / self.stored_name
        return step_dir / self.stored_name

    def referring(self, holder: int) -> FileEntry:
        """This entry (of step `holder`) as a later step records it when it reuses the bytes: every field
        copied, `source_step` naming the step that physically holds them."""
        return self.model_copy(update={"source_step": holder if self.source_step is None else self.source_step})


class TensorEntry(BaseModel):
    """Where a tensor is: `offsets` are absolute byte positions inside `file`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    file: str
    dtype: str
    shape: list[int]
    offsets: tuple[int, int]


class ShardEntry(BaseModel):
    """Where one rank's shard of a DTensor sits in the global tensor (`dcs_tasks.checkpoint.restore.boxread`): the
    tensor's `TensorEntry.shape` is the shard's shape, `offset` its first index along every dimension."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    global_shape: list[int]
    offset: list[int]
    placements: list[str]  # as saved, e.g. ["S(0)", "R"]: informative, restore needs only shape and offset
    mesh_shape: list[int]


class ChunkSums(BaseModel):
    """Checksums of every `chunk_bytes` piece of each listed tensor's bytes (the last piece may be shorter),
    so a read of part of a tensor verifies the chunks it reads without reading the whole file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    chunk_bytes: int = Field(gt=0)
    algorithm: str = CHUNK_ALGORITHM
    sums: dict[str, list[str]]


CREATED_AT_MAX = 7_258_118_400.0  # 2200-01-01 UTC: a manifest's `created_at` beyond it (or NaN, inf) is corrupt


class ManifestDraft(BaseModel):
    """Everything the trainer knows about a step before its files are written (stored in Redis)."""

    model_config = ConfigDict(extra="forbid")

    format_version: int = FORMAT_VERSION
    run: str
    step: int = Field(ge=0)
    tensors: dict[str, TensorEntry]
    structure: dict[str, Any]
    metadata: dict[str, Any] = Field(default_factory=dict)
    # seconds since the epoch; finite and 0..CREATED_AT_MAX, so every reader can format it as a date
    created_at: float = Field(ge=0, le=CREATED_AT_MAX, allow_inf_nan=False)
    versions: dict[str, str] = Field(default_factory=dict)
    rank: int = Field(default=0, ge=0)
    world_size: int = Field(default=1, ge=1)
    sharded_dims: dict[str, int] = Field(
        default_factory=dict, description="flat tensor name -> dimension it is split along across ranks"
    )
    # absent (None) in checkpoints without DTensors and in those written before they existed
    dtensors: dict[str, ShardEntry] | None = None
    chunks: ChunkSums | None = None


class Manifest(ManifestDraft):
    """`manifest.json`: written last; a step directory without it does not exist for readers."""

    files: list[FileEntry]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def stored_bytes(self) -> int:
        """Bytes the step's files take on disk (less than `total_bytes` when some are compressed)."""
        return sum(f.disk_size for f in self.files)


def tensor_index(layout: Layout) -> dict[str, TensorEntry]:
    return {
        slot.spec.name: TensorEntry(
            file=f.name,
            dtype=slot.spec.code,
            shape=list(slot.spec.shape),
            offsets=(f.data_start + slot.begin, f.data_start + slot.end),
        )
        for f in layout.files
        for slot in f.slots
    }


def draft_of(
    run: str, step: int, layout: Layout, structure: dict[str, Any], metadata: dict[str, Any], **extra: Any
) -> ManifestDraft:
    """The draft of a step about to be written from `layout` (tensor index, now, library versions); `extra`:
    the multi-rank fields (rank, world_size, sharded_dims, dtensors, chunks)."""
    return ManifestDraft(
        run=run,
        step=step,
        tensors=tensor_index(layout),
        structure=structure,
        metadata=metadata,
        created_at=time.time(),
        versions=library_versions(),
        **extra,
    )


def library_versions() -> dict[str, str]:
    """The versions a step is written with: the installed torch and safetensors distributions (read from
    their metadata, so this module imports neither) and Python."""
    return dict(_library_versions())


@functools.cache
def _library_versions() -> tuple[tuple[str, str], ...]:
    return (
        ("torch", importlib.metadata.version("torch")),
        ("safetensors", importlib.metadata.version("safetensors")),
        ("python", platform.python_version()),
    )


def manifest_bytes(manifest: Manifest) -> bytes:
    return json.dumps(manifest.model_dump(mode="json", exclude_none=True), indent=1, sort_keys=True).encode()


def read_manifest(path: Path) -> Manifest:
    return Manifest.model_validate_json(path.read_bytes())


# --- staging file names (the trainer writes them, the worker checks a payload's path against them) ----------


def staging_prefix(namespace: str, run: str) -> str:
    """The name prefix of the staging files of `run` (a shard run name in a multi-rank run)."""
    return f"dcs-{namespace}-{run}"


def staging_name_pattern(prefix: str) -> re.Pattern[str]:
    """Exactly <prefix>-<pid>-<8 hex>-<index>.stage (group 1: the pid): run "exp" never matches "exp-2"'s files."""
    return re.compile(rf"{re.escape(prefix)}-(\d+)-[0-9a-f]{{8}}-\d+\.stage")
