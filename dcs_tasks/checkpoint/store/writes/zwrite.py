"""Writing a checkpoint file zstd-compressed, durably (the write half of `dcs_tasks.checkpoint.format.compression`,
which describes the form): `write_region` probes the staged bytes and writes them compressed, or as they are through
`durable.stream_region` when they do not shrink enough; `compress_into` streams one frame into an open file.
"""

from __future__ import annotations

import mmap
import time
from collections.abc import Callable
from pathlib import Path

import zstandard

from dcs_tasks.checkpoint.format.compression import CompressionSpec, padding, probe_saving
from dcs_tasks.checkpoint.format.layout import FileEntry, new_hasher
from dcs_tasks.checkpoint.store.writes.durable import chunk_size, durable_file, pace, stream_region, write_all


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
    uncompressed file only): see `durable.durable_file` (NotPublished when it refuses the rename)."""
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
