"""Reading a compressed checkpoint file back, bounded (the read half of `dcs_tasks.checkpoint.format.compression`,
which describes the form and the limits): `check_frame` checks an open file's zstd frame header, `Decoder` yields its
uncompressed bytes in order, never more than the manifest's `size`. Every failure is CorruptCheckpoint naming the
file.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, cast

import zstandard

from dcs_tasks.checkpoint.format.compression import FRAME_HEADER_MAX, MAX_WINDOW_BYTES, READ_SIZE
from dcs_tasks.checkpoint.format.layout import FileEntry
from dcs_tasks.errors import CorruptCheckpoint
from dcs_tasks.storage import ObjectPath


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
