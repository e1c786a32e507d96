"""Reading a committed step back from its store and checking it as untrusted input (the I/O half of
`dcs_tasks.checkpoint.format.validate`, whose checks of bytes and parsed models it applies):
- `read_manifest`: `manifest.json` is a regular file (not a symlink) of bounded size that parses as a
  `Manifest`, `validate.check_manifest` holds, and a step directory named as DCS names it holds that step's
  manifest.
- `check_files`: each listed file is a regular file in the step directory (lstat, opened with O_NOFOLLOW:
  a symlink is refused, never followed) of exactly its recorded size, and its safetensors header (length
  bounded by the file and `MAX_HEADER_BYTES`, valid JSON, every entry's dtype, shape and byte range
  consistent and inside the file: `read_header`) lists exactly the manifest's tensors of that file at the same
  places. Costs one open and one small header read per file: no data bytes are read. A compressed file must
  have its `stored_size`, a zstd frame header recording exactly its `size`, and its header is read by
  decompressing only the header's bytes (`zdecode.Decoder`). An incremental reference's step directory
  must be a real directory (lstat: not a symlink), and the referenced file there is checked like any other.
Every failure is `CorruptCheckpoint` naming the file and the reason.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import struct
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from dcs_tasks.checkpoint.format.layout import MANIFEST_NAME, STEP_DIR, FileEntry, Manifest, TensorEntry
from dcs_tasks.checkpoint.format.validate import MAX_MANIFEST_BYTES, MAX_REASON, check_header_entry, check_manifest
from dcs_tasks.checkpoint.store.reads.zdecode import Decoder, check_frame
from dcs_tasks.errors import CorruptCheckpoint
from dcs_tasks.storage import Location, store_of
from dcs_tasks.storage.fs import open_regular

STEP_FOLDER_FILES = 100_000  # a step folder listed for sizes holds a step's files: more is not a checkpoint
HEAD_PREFETCH = 256 * 1024  # bytes of an object fetched at once for its safetensors header
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the limit safetensors itself applies


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


def check_files(step_dir: Location, manifest: Manifest) -> None:
    """Each file of `manifest` (already checked) against the disk: a regular file of its recorded size whose
    safetensors header agrees with the manifest. Reads only the headers."""
    by_file: dict[str, dict[str, TensorEntry]] = {f.name: {} for f in manifest.files}
    for name, entry in manifest.tensors.items():
        by_file[entry.file][name] = entry
    local = store_of(step_dir).local_path(step_dir)
    if local is None:  # no descriptor to check through: sizes from listings, headers by ranged reads
        _check_through_store(step_dir, manifest, by_file)
        return
    for f in manifest.files:
        path = f.stored_path(local)
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


def _check_through_store(step_dir: Location, manifest: Manifest, by_file: dict[str, dict[str, TensorEntry]]) -> None:
    """`check_files` for a step whose store lends no local file (an object store): each file exists with its
    recorded size, from one listing per folder (`Store.files`), and, stored plain, its safetensors header (read
    into memory with `Store.read_into`) agrees with the manifest. A compressed file's frame and header are checked
    when it is read (fetched whole, then decompressed: `objread`)."""
    store = store_of(step_dir)
    listings: dict[str, dict[str, int]] = {}
    for f in manifest.files:
        path = f.stored_path(step_dir)
        folder = path.parent
        if str(folder) not in listings:
            listings[str(folder)] = store.files(folder, STEP_FOLDER_FILES)
        size = listings[str(folder)].get(path.name)
        if size is None:
            raise CorruptCheckpoint(f"checkpoint object {path} is missing", str(path))
        if size != f.disk_size:
            raise CorruptCheckpoint(
                f"checkpoint object {path} has {size} bytes, manifest says {f.disk_size}", str(path)
            )
        if not f.compression:
            _check_header(-1, path, size, by_file[f.name], _store_reader(path, size))


def _store_reader(path: Location, size: int) -> Callable[[int], bytes]:
    """`read(n)`: the file's next n bytes from its start, through its store. The first `HEAD_PREFETCH` bytes come
    with one read (one ranged GET: a header is almost always shorter), the rest, if a header is longer, with
    one more."""
    store = store_of(path)
    pos = 0
    first = bytearray(min(size, HEAD_PREFETCH))
    fetched = False

    def read(n: int) -> bytes:
        nonlocal pos, fetched
        n = max(0, min(n, size - pos))
        if not fetched and first:
            store.read_into(path, 0, [memoryview(first)])  # a missing object: CorruptCheckpoint
            fetched = True
        if pos + n <= len(first):
            out = bytes(first[pos : pos + n])
        else:
            buf = bytearray(n)
            if n:
                store.read_into(path, pos, [memoryview(buf)])
            out = bytes(buf)
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
            check_header_entry(path, name, entry, data)
    return header, 8 + length


def _sequential_pread(fd: int) -> Callable[[int], bytes]:
    pos = [0]

    def read(n: int) -> bytes:
        data = os.pread(fd, n, pos[0])
        pos[0] += len(data)
        return data

    return read
