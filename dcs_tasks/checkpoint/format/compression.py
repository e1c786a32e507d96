"""Optional per-file zstd compression of checkpoint files: done by the worker, read back transparently.

The trainer only records its choice (`CompressionSpec`: codec, level, minimum saving, from `DCSConfig`) in
each persist task; `save()`'s stall is unchanged. This module holds the form of a compressed file and what can be
checked without reading one (no I/O); writing one is `dcs_tasks.checkpoint.store.writes.zwrite`, reading one
`dcs_tasks.checkpoint.store.reads.zdecode` (`Decoder`, `check_frame`). The worker (`zwrite.write_region`):
- probes the staged file first: `PROBE_PIECES` pieces of `PROBE_PIECE_BYTES` spread over it are compressed
  at the requested level (~1 MiB, a few ms); when they shrink by less than `min_saving` the file is written
  as it is (the plain O_DIRECT path, `durable.stream_region`), so bytes that do not compress (random-looking
  bf16 mantissas, already-compressed data) cost no CPU for nothing;
- otherwise streams the staging region in `WRITE_CHUNK_BYTES` pieces: each piece is hashed (xxh3_128 of the
  UNcompressed bytes: `FileEntry.checksum` and `size` mean the same for every file) and fed to one zstd
  stream (`threads` worker threads of zstd, from the worker's own config; the frame records the content
  size), whose output goes to a temp file, buffered (compressed output has no alignment for O_DIRECT),
  fsynced, renamed to `<name>.zst`, directory fsynced (`durable.durable_file`). The entry records
  `compression="zstd"` and `stored_size`.

Expansion limit: a compressed file never holds more than `MAX_EXPANSION` (256) times its bytes on disk. zstd
itself could reach 32,768x (4 bytes per block of 128 KiB of one repeated byte), which let a file of 262 KB on
disk make restore allocate and fill 8 GiB. Real checkpoints measured x1.09 (fp32 AdamW moments) to x5.95
(int token ids) per kind (bench/compression.py), so 256 is 43x above the most compressible real kind; only
near-constant files (all-zero tensors) go past it, and the writer keeps those to the limit too: when its
frame is smaller than `size / MAX_EXPANSION` it appends zstd skippable frames (which decoders skip, and ours
never reads: it stops at the end of the first frame) up to that size, a cost of 4 MiB per GiB of zeros.

Reading (untrusted files, `validate`, `stepcheck` and `zread`): the manifest's `stored_size` must lie between
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
from typing import Annotated, Literal

import zstandard
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from dcs_tasks.checkpoint.format.layout import COMPRESSED_SUFFIX, FileEntry

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
