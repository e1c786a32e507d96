"""`format.nogil`: xxh3-128 through the xxhash extension's C API (GIL released) gives xxhash's own digest, in one
call (`digest`) and streamed (`Hasher`, what `new_hasher` hands out), from any contiguous buffer."""

from __future__ import annotations

import ctypes
import mmap
import os
import tempfile

import pytest
import xxhash

from dcs_tasks.checkpoint.format import nogil
from dcs_tasks.checkpoint.format.layout import new_hasher


@pytest.mark.parametrize("size", [1, 4095, nogil.STEP, nogil.STEP + 1, 3 * nogil.STEP - 7])
def test_digest_matches_the_streaming_hasher(size: int) -> None:
    assert nogil.available(), "the installed xxhash exports the XXH3 C API (else restores hash with the GIL held)"
    data = os.urandom(size)
    buffer = (ctypes.c_char * size).from_buffer_copy(data)
    assert nogil.digest(ctypes.addressof(buffer), size) == xxhash.xxh3_128(data).hexdigest()


@pytest.mark.parametrize(
    ("size", "piece"), [(0, 1), (1, 1), (9000, 1), (nogil.STEP, 4095), (2 * nogil.STEP + 5, nogil.STEP + 3)]
)
def test_the_streaming_hasher_gives_xxhashs_digest_however_the_bytes_are_split(size: int, piece: int) -> None:
    data = os.urandom(size)
    ours = new_hasher()
    assert isinstance(ours, nogil.Hasher)
    for begin in range(0, size, piece):
        ours.update(memoryview(data)[begin : begin + piece] if begin % 2 else bytearray(data[begin : begin + piece]))
    assert ours.hexdigest() == xxhash.xxh3_128(data).hexdigest()
    assert ours.hexdigest() == ours.hexdigest()  # asking twice changes nothing


def test_the_streaming_hasher_reads_a_read_only_mapping_and_leaves_it_closable() -> None:
    data = os.urandom(3 * nogil.STEP + 11)
    with tempfile.TemporaryFile() as file:
        file.write(data)
        file.flush()
        mapping = mmap.mmap(file.fileno(), len(data), mmap.MAP_SHARED, mmap.PROT_READ)
        hasher = nogil.Hasher()
        with memoryview(mapping) as whole:
            for begin in range(0, len(data), nogil.STEP):
                with whole[begin : begin + nogil.STEP] as piece:
                    hasher.update(piece)
        mapping.close()  # no export of the mapping is left behind (BufferError otherwise)
    assert hasher.hexdigest() == xxhash.xxh3_128(data).hexdigest()
    with pytest.raises(BufferError, match="contiguous"):
        nogil.Hasher().update(memoryview(data)[::2])


def test_map_many_verifies_the_same_without_it(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    from pathlib import Path

    from dcs_tasks.checkpoint.format.layout import FileEntry
    from dcs_tasks.checkpoint.restore import lend
    from dcs_tasks.errors import CorruptCheckpoint

    root = Path(str(tmp_path))
    files = []
    for i, size in enumerate((5000, 70000, 0)):
        path = root / f"f{i}"
        data = os.urandom(size)
        path.write_bytes(data)
        hasher = new_hasher()
        hasher.update(data)
        files.append((path, FileEntry(name=path.name, size=size, checksum=hasher.hexdigest())))
    for available in (True, False):
        monkeypatch.setattr(nogil, "available", lambda available=available: available)
        for (path, _), mapping in zip(files, lend.map_many(files, verify=True), strict=True):
            assert bytes(mapping[: path.stat().st_size]) == path.read_bytes()
        bad = files[1][0]
        raw = bytearray(bad.read_bytes())
        raw[100] ^= 1
        bad.write_bytes(bytes(raw))
        with pytest.raises(CorruptCheckpoint, match="f1 fails"):
            lend.map_many(files, verify=True)
        raw[100] ^= 1
        bad.write_bytes(bytes(raw))
