"""Optional per-file zstd compression of checkpoint files: done by the worker, read back transparently.

The trainer only records its choice (`CompressionSpec`: codec, level, minimum saving, from `DCSConfig`) in
each persist task; `save()`'s stall is unchanged. The worker (`write_region`):
- probes the staged file first: `PROBE_PIECES` pieces of `PROBE_PIECE_BYTES` spread over it are compressed
  at the requested level (~1 MiB, a few ms); when they shrink by less than `min_saving` the file is written
  as it is (the plain O_DIRECT path, `fsio.stream_region`), so bytes that do not compress (random-looking
  bf16 mantissas, already-compressed data) cost no CPU for nothing;
- otherwise streams the staging region in `WRITE_CHUNK_BYTES` pieces: each piece is hashed (xxh3_128 of the
  UNcompressed bytes: `FileEntry.checksum` and `size` mean the same for every file) and fed to one zstd
  stream (`threads` worker threads of zstd, from the worker's own config; the frame records the content
  size), whose output goes to a temp file, buffered (compressed output has no alignment for O_DIRECT),
  fsynced, renamed to `<name>.zst`, directory fsynced (`fsio.durable_file`). The entry records
  `compression="zstd"` and `stored_size`.

Expansion limit: a compressed file never holds more than `MAX_EXPANSION` (256) times its bytes on disk. zstd
itself could reach 32,768x (4 bytes per block of 128 KiB of one repeated byte), which let a file of 262 KB on
disk make restore allocate and fill 8 GiB. Real checkpoints measured x1.09 (fp32 AdamW moments) to x5.95
(int token ids) per kind (bench/compression.py), so 256 is 43x above the most compressible real kind; only
near-constant files (all-zero tensors) go past it, and the writer keeps those to the limit too: when its
frame is smaller than `size / MAX_EXPANSION` it appends zstd skippable frames (which decoders skip, and ours
never reads: it stops at the end of the first frame) up to that size, a cost of 4 MiB per GiB of zeros.

Reading (untrusted files, `validate` and `zread`): the manifest's `stored_size` must lie between
`min_stored_size` (`size / MAX_EXPANSION`, checked before anything is allocated or decompressed) and zstd's
worst case (`compress_bound`); the file
must have exactly `stored_size` bytes and its frame header must record exactly `size` bytes and a window of
at most `MAX_WINDOW_BYTES`. A `Decoder` then never produces more than `size` bytes (reads are bounded by the
caller's buffers) and fails when the frame ends early, goes on past `size`, or is not valid zstd: every
failure is CorruptCheckpoint naming the file. So a decompression bomb costs at most the bytes the manifest
claims, which `min_stored_size` ties to 256 times the bytes on disk.
"""

from __future__ import annotations

import math
import mmap
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Annotated, Any, Literal, cast

import zstandard
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from dcs_tasks.checkpoint.format.fsio import chunk_size, durable_file, pace, stream_region, write_all
from dcs_tasks.checkpoint.format.layout import COMPRESSED_SUFFIX, FileEntry, new_hasher
from dcs_tasks.errors import CorruptCheckpoint
from dcs_tasks.storage import ObjectPath

CODEC = "zstd"
MIN_LEVEL, MAX_LEVEL = -7, 19  # negative: zstd's fast levels; 20-22 ("ultra") need up to ~1 GiB per stream
MAX_EXPANSION = 256  # uncompressed bytes per stored byte, at most (see above: real kinds measured x1.09-x5.95)
SKIPPABLE_MAGIC = b"\x50\x2a\x4d\x18"  # a zstd skippable frame (0x184D2A50, little-endian), then its length
SKIPPABLE_MAX = (1 << 32) - 1  # the longest skippable frame's content
MIN_FRAME_BYTES = 9  # the smallest zstd frame (magic, descriptor, one empty last block)
FRAME_HEADER_MAX = 18  # magic + the largest frame header
MAX_WINDOW_BYTES = 1 << 27  # what zstd decoders accept by default; levels <= 19 use at most 8 MiB
PROBE_PIECES = 8
PROBE_PIECE_BYTES = 128 * 1024
READ_SIZE = 1 << 20  # compressed bytes the decoder reads at a time


class CompressionSpec(BaseModel):
    """What a persist task is asked to do with its file (from the trainer's config; payloads are untrusted)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    codec: Literal["zstd"] = "zstd"
    level: Annotated[StrictInt, Field(ge=MIN_LEVEL, le=MAX_LEVEL)] = 1
    min_saving: float = Field(default=0.05, ge=0.0, le=1.0, allow_inf_nan=False)


def compress_bound(size: int) -> int:
    """More than zstd's worst case for `size` input bytes (ZSTD_compressBound is size + size/256 + < 100)."""
    return size + (size >> 8) + 1024


def min_stored_size(size: int) -> int:
    """The fewest bytes a compressed file holding `size` bytes may take (`MAX_EXPANSION`)."""
    return max(MIN_FRAME_BYTES, math.ceil(size / MAX_EXPANSION))


def padding(stored: int, size: int) -> bytes:
    """Skippable frames that bring a `stored`-byte frame of `size` bytes up to `min_stored_size(size)`
    (empty when it is there already)."""
    short = min_stored_size(size) - stored
    frames = []
    while short > 0:
        body = min(max(short - 8, 0), SKIPPABLE_MAX)
        frames.append(SKIPPABLE_MAGIC + body.to_bytes(4, "little") + bytes(body))
        short -= 8 + body
    return b"".join(frames)


def stored_size_problem(entry: FileEntry) -> str | None:
    """Why the manifest entry's compression fields cannot be right, or None (checked before any path is built)."""
    name = entry.name[:80]
    if entry.compression is None:
        return None if entry.stored_size is None else f"file {name!r} records a stored size but no compression"
    if entry.compression not in COMPRESSED_SUFFIX:
        return f"file {name!r} has compression {entry.compression[:32]!r}, not one DCS reads ({CODEC})"
    if entry.stored_size is None:
        return f"file {name!r} is compressed but records no stored size"
    low, high = min_stored_size(entry.size), compress_bound(entry.size)
    if not low <= entry.stored_size <= high:
        return (
            f"file {name!r}: {entry.stored_size} {entry.compression} bytes cannot hold {entry.size} bytes "
            f"(between {low} and {high}: at most {MAX_EXPANSION}x expansion)"
        )
    return None


def probe_saving(view: memoryview, level: int) -> float:
    """Fraction by which a sample of `view` (`PROBE_PIECES` pieces spread over it) shrinks at `level`."""
    n = len(view)
    piece = PROBE_PIECE_BYTES
    if n <= PROBE_PIECES * piece:
        sample = bytes(view)
    else:
        starts = [i * (n - piece) // (PROBE_PIECES - 1) for i in range(PROBE_PIECES)]
        sample = b"".join(view[s : s + piece] for s in starts)
    if not sample:
        return 0.0
    return 1.0 - len(zstandard.ZstdCompressor(level=level).compress(sample)) / len(sample)


def write_region(
    source: Path,
    offset: int,
    length: int,
    final: Path,
    tag: str,
    spec: CompressionSpec | None,
    threads: int = 0,
    throttle_bytes_per_second: float | None = None,
    publish: Callable[[], bool] | None = None,
    recycled: Path | None = None,
) -> FileEntry:
    """Persist `length` bytes at `offset` (page-aligned) of `source` as the step file `final` (its manifest
    name): as they are without `spec` or when the probe says they do not shrink enough, else zstd-compressed
    as `final` + ".zst". Durable either way; returns the file's manifest entry. `publish` and `recycled` (an
    uncompressed file only): see `fsio.durable_file` (NotPublished when it refuses the rename)."""
    if spec is not None and length > 0:
        with open(source, "rb") as src:
            mapping = mmap.mmap(src.fileno(), length, mmap.MAP_SHARED, mmap.PROT_READ, offset=offset)
        try:
            with memoryview(mapping) as view:
                if spec.min_saving <= 0 or probe_saving(view, spec.level) >= spec.min_saving:
                    return _write_compressed(view, final, tag, spec, threads, throttle_bytes_per_second, publish)
        finally:
            mapping.close()
    checksum = stream_region(source, offset, length, final, tag, throttle_bytes_per_second, publish, recycled)
    return FileEntry(name=final.name, size=length, checksum=checksum)


def _write_compressed(
    view: memoryview,
    final: Path,
    tag: str,
    spec: CompressionSpec,
    threads: int,
    throttle: float | None,
    publish: Callable[[], bool] | None = None,
) -> FileEntry:
    entry = FileEntry(name=final.name, size=len(view), checksum="", compression=spec.codec, stored_size=0)
    with durable_file(entry.stored_path(final.parent), tag, publish=publish) as fd:
        checksum, stored = compress_into(view, fd, spec, threads, throttle)
    return entry.model_copy(update={"checksum": checksum, "stored_size": stored})


def compress_into(
    view: memoryview, fd: int, spec: CompressionSpec, threads: int = 0, throttle: float | None = None
) -> tuple[str, int]:
    """Write `view` zstd-compressed to the open file `fd` (one frame recording the size, padded up to the
    expansion limit readers enforce); returns (xxh3_128 of the uncompressed bytes, bytes written)."""
    hasher = new_hasher()
    length = len(view)
    compressor = zstandard.ZstdCompressor(level=spec.level, write_checksum=False, threads=threads)
    stream = compressor.compressobj(size=length)
    stored = 0
    started = time.monotonic()
    chunk = chunk_size(throttle)
    for pos in range(0, length, chunk):
        with view[pos : pos + chunk] as piece:
            hasher.update(piece)
            out = stream.compress(piece)
        write_all(fd, memoryview(out))
        stored += len(out)
        pace(started, pos + chunk, throttle)
    out = stream.flush()
    out += padding(stored + len(out), length)  # never past the expansion limit readers enforce
    write_all(fd, memoryview(out))
    stored += len(out)
    return str(hasher.hexdigest()), stored


def check_frame(fd: int, path: Path | ObjectPath, entry: FileEntry) -> None:
    """The zstd frame header of an open compressed file records exactly `entry.size` bytes and a window
    decoders accept (no data is decompressed)."""
    head = os.pread(fd, FRAME_HEADER_MAX, 0)
    try:
        content = zstandard.frame_content_size(head)
        window = zstandard.get_frame_parameters(head).window_size
    except zstandard.ZstdError as exc:
        raise CorruptCheckpoint(f"checkpoint file {path} does not start with a zstd frame ({exc})", str(path)) from exc
    if content != entry.size:
        what = "no size" if content < 0 else f"{content} bytes"
        raise CorruptCheckpoint(
            f"checkpoint file {path}: its zstd frame records {what}, the manifest {entry.size}", str(path)
        )
    if window > MAX_WINDOW_BYTES:
        raise CorruptCheckpoint(f"checkpoint file {path}: zstd window of {window} bytes is refused", str(path))


class _Source:
    """The compressed bytes of an open file, read with pread (the descriptor's offset is never used)."""

    def __init__(self, fd: int, path: Path | ObjectPath) -> None:
        self.fd, self.path, self.pos = fd, path, 0

    def read(self, size: int = -1) -> bytes:
        try:
            data = os.pread(self.fd, READ_SIZE if size < 0 else size, self.pos)
        except OSError as exc:
            raise CorruptCheckpoint(
                f"checkpoint file {self.path} cannot be read: {exc.strerror}", str(self.path)
            ) from exc
        self.pos += len(data)
        return data


class Decoder:
    """The uncompressed bytes of a compressed checkpoint file, in order, never more than `entry.size`
    (call `check_frame` first). Every failure is CorruptCheckpoint naming the file."""

    def __init__(self, fd: int, path: Path | ObjectPath, entry: FileEntry) -> None:
        self.path = path
        self.size = entry.size
        self.pos = 0
        decompressor = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW_BYTES)
        source = cast(IO[bytes], _Source(fd, path))  # zstandard only calls read()
        self._reader = decompressor.stream_reader(source, read_size=READ_SIZE, read_across_frames=False)

    def readinto(self, view: memoryview) -> None:
        """Fill `view` with the next `len(view)` bytes (at most up to `size`)."""
        want = len(view)
        if self.pos + want > self.size:
            raise CorruptCheckpoint(f"read past the {self.size} bytes of {self.path}", str(self.path))
        done = 0
        while done < want:
            with view[done:] as rest:
                n = self._call(self._reader.readinto, rest)
            if n <= 0:
                raise CorruptCheckpoint(
                    f"checkpoint file {self.path} decompresses to {self.pos + done} bytes, the manifest says "
                    f"{self.size}",
                    str(self.path),
                )
            done += n
        self.pos += want

    def read(self, n: int) -> bytes:
        buf = bytearray(n)
        self.readinto(memoryview(buf))
        return bytes(buf)

    def finish(self) -> None:
        """After all `size` bytes: the frame must end there."""
        if self.pos != self.size or self._call(self._reader.read, 1):
            raise CorruptCheckpoint(
                f"checkpoint file {self.path} decompresses to more than the manifest's {self.size} bytes",
                str(self.path),
            )

    def _call(self, fn: Callable[[Any], Any], arg: Any) -> Any:
        try:
            return fn(arg)
        except zstandard.ZstdError as exc:
            raise CorruptCheckpoint(f"checkpoint file {self.path} is not valid zstd ({exc})", str(self.path)) from exc
