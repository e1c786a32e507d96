"""`format.nogil`: xxh3-128 through the xxhash extension's C API (GIL released) gives `new_hasher`'s digest."""

from __future__ import annotations

import ctypes
import os

import pytest

from dcs_tasks.checkpoint.format import nogil
from dcs_tasks.checkpoint.format.layout import new_hasher


@pytest.mark.parametrize("size", [1, 4095, nogil.STEP, nogil.STEP + 1, 3 * nogil.STEP - 7])
def test_digest_matches_the_streaming_hasher(size: int) -> None:
    assert nogil.available(), "the installed xxhash exports the XXH3 C API (else restores hash with the GIL held)"
    data = os.urandom(size)
    buffer = (ctypes.c_char * size).from_buffer_copy(data)
    hasher = new_hasher()
    hasher.update(data)
    assert nogil.digest(ctypes.addressof(buffer), size) == hasher.hexdigest()


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
