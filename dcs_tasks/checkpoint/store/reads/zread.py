"""Verified reads of compressed checkpoint files, for `fileread.read_many` / `read_scatter`.

A step may mix compressed and plain files. The plain ones go through fileread's pipeline unchanged (chunked
O_DIRECT or buffered `preadv` by several threads); meanwhile each compressed file is decompressed by one
thread of its own (zstd releases the GIL; up to `IO_THREADS` files at once), sequentially, in
`CHUNK_BYTES` steps (both as fileread's, from `iosizes`): every step's bytes land straight in their
destination (the file's fresh mapping for `read_many`, the caller's tensors and a scratch buffer for the
gaps for `read_scatter`) and are hashed there, so the uncompressed bytes are checked against the same
xxh3_128 checksum as a plain file's. The file's size, frame header and bounds are checked first
(`zdecode.check_frame`, `Decoder`: never more than the manifest's `size` bytes are produced). Every
failure is CorruptCheckpoint naming the file; nothing is still being written when a function returns or
raises. fileread hands its own plain-file readers in (`raw`); this module imports only what they land in
(`landing`), never fileread.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from dcs_tasks.checkpoint.format.iosizes import READ_CHUNK_BYTES, READ_THREADS
from dcs_tasks.checkpoint.format.layout import FileEntry, new_hasher
from dcs_tasks.checkpoint.store.reads.landing import Progress, Target, TargetIndex, anonymous
from dcs_tasks.checkpoint.store.reads.stepcheck import open_stored
from dcs_tasks.checkpoint.store.reads.zdecode import Decoder, check_frame
from dcs_tasks.errors import CorruptCheckpoint
from dcs_tasks.storage import ObjectPath

CHUNK_BYTES = READ_CHUNK_BYTES  # decompressed bytes per step (fileread's chunk size; tests patch it here)
IO_THREADS = READ_THREADS  # compressed files decoded at once
Land = Callable[[int, int], list[memoryview]]  # (begin, end) of the file -> destination views in order
RawMany = Callable[[list[tuple[Path, FileEntry]], bool, "Progress | None"], list[mmap.mmap]]
RawScatter = Callable[[list[tuple[Path, FileEntry, list[Target]]], bool, "Progress | None"], None]


def decode(path: Path, entry: FileEntry, verify: bool, land: Land, progress: Progress | None) -> None:
    """Decompress the whole file into `land`'s views, checking size, frame, end and (`verify`) checksum."""
    fd = open_stored(path, entry)
    try:
        decode_fd(fd, path, entry, verify, land, progress)
    finally:
        os.close(fd)


def decode_fd(
    fd: int, path: Path | ObjectPath, entry: FileEntry, verify: bool, land: Land, progress: Progress | None
) -> None:
    """`decode` of the compressed bytes in the open file `fd` (a checkpoint file, or an object fetched whole
    into a memfd: `objread`); `path` names them in errors."""
    check_frame(fd, path, entry)
    decoder = Decoder(fd, path, entry)
    hasher = new_hasher() if verify else None
    for begin in range(0, entry.size, CHUNK_BYTES):
        end = min(begin + CHUNK_BYTES, entry.size)
        for piece in land(begin, end):
            with piece:
                decoder.readinto(piece)
                if hasher is not None:
                    hasher.update(piece)
        if progress is not None:
            progress(entry.name, end, entry.size)
    decoder.finish()
    if hasher is not None and hasher.hexdigest() != entry.checksum:
        raise CorruptCheckpoint(f"checkpoint file {path} fails its {entry.algorithm} checksum", str(path))


def _all(jobs: list[Callable[[], None]], alongside: Callable[[], None]) -> None:
    """Run `jobs` on up to IO_THREADS threads and `alongside` here; wait for every one, then raise the first
    failure (`alongside`'s first, then the jobs' in order)."""
    with ThreadPoolExecutor(max(1, min(IO_THREADS, len(jobs))), thread_name_prefix="dcs-unzstd") as pool:
        futures: list[Future[None]] = [pool.submit(job) for job in jobs]
        try:
            alongside()
        finally:
            errors = [f.exception() for f in futures]  # waits for each
    for error in errors:
        if error is not None:
            raise error


def read_many(
    files: list[tuple[Path, FileEntry]], verify: bool, progress: Progress | None, raw: RawMany
) -> list[mmap.mmap]:
    """`fileread.read_many` of a list holding compressed files: each file's bytes in its own fresh mapping."""
    packed = [(path, entry) for path, entry in files if entry.compression]
    plain = [(path, entry) for path, entry in files if not entry.compression]
    mappings = [anonymous(entry.size) for _, entry in packed]
    plain_maps: list[mmap.mmap] = []

    def job(path: Path, entry: FileEntry, mapping: mmap.mmap) -> Callable[[], None]:
        def run() -> None:
            with memoryview(mapping) as whole:
                decode(path, entry, verify, lambda b, e: [whole[b:e]], progress)

        return run

    def read_plain() -> None:
        if plain:
            plain_maps.extend(raw(plain, verify, progress))

    _all([job(p, e, m) for (p, e), m in zip(packed, mappings, strict=True)], read_plain)
    by_packed, by_plain = iter(mappings), iter(plain_maps)
    return [next(by_packed) if entry.compression else next(by_plain) for _, entry in files]


def read_scatter(
    files: list[tuple[Path, FileEntry, list[Target]]],
    verify: bool,
    progress: Progress | None,
    raw: RawScatter,
) -> None:
    """`fileread.read_scatter` of a list holding compressed files: each byte lands in its target, gaps (and
    with no targets, everything) in scratch."""
    packed = [item for item in files if item[1].compression]
    plain = [item for item in files if not item[1].compression]

    def job(path: Path, entry: FileEntry, targets: list[Target]) -> Callable[[], None]:
        def run() -> None:
            sorted_targets = TargetIndex(targets)
            scratch = anonymous(min(CHUNK_BYTES, entry.size))
            try:
                with memoryview(scratch) as slot:
                    decode(path, entry, verify, lambda b, e: sorted_targets.pieces(slot, b, e), progress)
            finally:
                scratch.close()

        return run

    def read_plain() -> None:
        if plain:
            raw(plain, verify, progress)

    _all([job(p, e, t) for p, e, t in packed], read_plain)
