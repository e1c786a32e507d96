"""fileread: chunked verified reads land every byte where it belongs, on disk with O_DIRECT, on disk buffered
(as where a file system refuses O_DIRECT) and on tmpfs, across chunk and file boundaries; a bad or short
file is named. Also `lend`, the memory tier's mapped reads, on the same files."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dcs_tasks.checkpoint.format.layout import FileEntry, new_hasher
from dcs_tasks.checkpoint.restore import lend
from dcs_tasks.checkpoint.store.reads import fileread
from dcs_tasks.errors import CorruptCheckpoint

SIZES = (3 * 65536 + 777, 65536, 4096 * 5, 1)  # ragged, exactly one chunk, page multiple, one byte


@pytest.fixture(params=["disk", "disk-buffered", "tmpfs"])
def where(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    if request.param.startswith("disk"):
        if request.param == "disk-buffered":
            monkeypatch.setattr(fileread, "O_DIRECT", 0)
        yield tmp_path
        return
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm on this machine")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        yield Path(shm)


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fileread, "CHUNK_BYTES", 65536)  # many chunks per file, several files per window


def _write(directory: Path, name: str, size: int, seed: int) -> tuple[Path, FileEntry]:
    data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    path = directory / name
    path.write_bytes(data.numpy().tobytes())
    _evict(path)  # on disk, restore reads with O_DIRECT only what is not cached
    hasher = new_hasher()
    hasher.update(data.numpy().tobytes())
    return path, FileEntry(name=name, size=size, checksum=hasher.hexdigest())


def _evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _files(directory: Path) -> list[tuple[Path, FileEntry]]:
    return [_write(directory, f"f{i}", size, i) for i, size in enumerate(SIZES)]


def test_read_many_returns_every_file_bit_exact(where: Path) -> None:
    files = _files(where)
    seen: dict[str, int] = {}
    mappings = fileread.read_many(files, verify=True, progress=lambda name, done, size: seen.__setitem__(name, done))
    for (path, entry), mapping in zip(files, mappings, strict=True):
        assert mapping[: entry.size] == path.read_bytes()
        assert seen[entry.name] == entry.size


def test_read_scatter_fills_ranges_across_chunk_boundaries_and_nothing_else(where: Path) -> None:
    files = _files(where)
    first, last = files[0], files[-1]
    spans = [(0, 10), (65530, 65536 * 2 + 3), (3 * 65536 + 1, SIZES[0])]  # header-like, straddling, tail
    dests = [torch.full((end - begin + 2,), 0xAB, dtype=torch.uint8) for begin, end in spans]
    targets = [(begin, end, dest[1:-1].numpy().data) for (begin, end), dest in zip(spans, dests, strict=True)]
    one = torch.zeros(1, dtype=torch.uint8)
    fileread.read_scatter(
        [
            (first[0], first[1], targets),
            *[(p, e, []) for p, e in files[1:-1]],
            (last[0], last[1], [(0, 1, one.numpy().data)]),
        ],
        verify=True,
    )
    raw = first[0].read_bytes()
    for (begin, end), dest in zip(spans, dests, strict=True):
        assert dest[1:-1].numpy().tobytes() == raw[begin:end]
        assert dest[0] == 0xAB and dest[-1] == 0xAB  # neighbours untouched
    assert one.numpy().tobytes() == last[0].read_bytes()


@pytest.mark.parametrize("mode", ["many", "scatter"])
def test_flipped_byte_and_short_file_are_named(where: Path, mode: str) -> None:
    files = _files(where)
    path, entry = files[0]
    with open(path, "r+b") as f:
        f.seek(2 * 65536 + 5)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))

    def read(files: list[tuple[Path, FileEntry]]) -> None:
        if mode == "many":
            fileread.read_many(files, verify=True)
        else:
            fileread.read_scatter([(p, e, []) for p, e in files], verify=True)

    with pytest.raises(CorruptCheckpoint, match=f"{path}.*checksum"):
        read(files)
    fileread.read_many([(path, entry)], verify=False)  # unverified reads do not hash
    os.truncate(files[1][0], 100)
    with pytest.raises(CorruptCheckpoint, match=f"{files[1][0]} has 100 bytes"):
        read(files[1:])


def test_cached_fraction_sees_the_page_cache(tmp_path: Path) -> None:
    path, entry = _write(tmp_path, "f", 8 << 20, 0)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert fileread.cached_fraction(fd, entry.size) < 0.5  # just evicted: read from disk (O_DIRECT)
        while os.read(fd, 1 << 20):
            pass
        assert fileread.cached_fraction(fd, entry.size) == 1.0  # all cached: a buffered copy is faster
    finally:
        os.close(fd)


def test_read_scatter_many_small_targets_in_one_chunk(where: Path) -> None:
    path, entry = _write(where, "many", 65536, 9)  # one chunk, more pieces than one preadv takes
    dest = torch.zeros(3 * 2000, dtype=torch.uint8)
    view = dest.numpy().data
    targets = [(5 + 4 * i, 8 + 4 * i, view[3 * i : 3 * i + 3]) for i in range(2000)]
    fileread.read_scatter([(path, entry, targets)], verify=True)
    raw = path.read_bytes()
    assert dest.numpy().tobytes() == b"".join(raw[5 + 4 * i : 8 + 4 * i] for i in range(2000))


def test_map_many_lends_the_files_pages_verified_and_copy_on_write(where: Path) -> None:
    files = [_write(where, f"f{i}", size, seed=i) for i, size in enumerate(SIZES)]
    mappings = lend.map_many(files, verify=True)
    for (path, _), mapping in zip(files, mappings, strict=True):
        original = path.read_bytes()
        assert bytes(mapping[: len(original)]) == original
        mapping[0] = (original[0] + 1) % 256  # a write to a lent page copies it: the file keeps its bytes
        assert path.read_bytes() == original
        mapping.close()


def test_map_many_names_a_bad_file_and_refuses_one_a_writer_holds(where: Path) -> None:
    import fcntl

    path, entry = _write(where, "bad", 65536 + 5, seed=3)
    raw = bytearray(path.read_bytes())
    raw[70000 % len(raw)] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpoint, match="fails its"):
        lend.map_many([(path, entry)], verify=True)
    good, good_entry = _write(where, "good", 4096, seed=4)
    fd = os.open(good, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a recycled file being overwritten
        with pytest.raises(lend.Unmappable):
            lend.map_many([(good, good_entry)], verify=True)
    finally:
        os.close(fd)


def test_a_sealed_file_is_lent_or_copied_without_a_hash_and_a_changed_one_is_not_trusted(
    where: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dcs_tasks.checkpoint.store.tiers.seal import read_seals, seal_step

    files = _files(where)
    names = [path.name for path, _ in files]
    stamps = seal_step(where, names)
    assert read_seals(where) == stamps and all(os.stat(path).st_mode & 0o777 == 0o444 for path, _ in files)
    hashed: list[str] = []
    check = lend._check
    monkeypatch.setattr(lend, "_check", lambda path, entry, m: (hashed.append(path.name), check(path, entry, m)))

    mappings = lend.map_many(files, verify=True, seals=stamps)  # the pages, not hashed again
    assert hashed == [] and [bytes(m[: e.size]) for m, (_, e) in zip(mappings, files, strict=True)] == [
        p.read_bytes() for p, _ in files
    ]
    for mapping in mappings:
        mapping.close()

    raw = files[0][0].read_bytes()
    dest = bytearray(len(raw))
    targets = [(0, 100, memoryview(dest)[:100]), (4096, len(raw), memoryview(dest)[4096:])]
    lend.copy_sealed([(files[0][0], files[0][1], targets)], True, stamps)
    assert dest[:100] == raw[:100] and dest[4096:] == raw[4096:] and not any(dest[100:4096])

    os.chmod(files[0][0], 0o644)  # any change of the file moves its stamp: it is hashed, and fails here
    with open(files[0][0], "r+b") as f:
        f.write(b"\0" if raw[0] else b"\1")
    with pytest.raises(CorruptCheckpoint, match="fails its"):
        lend.map_many(files, verify=True, seals=stamps)
    assert hashed == [names[0]]
    with pytest.raises(lend.Unmappable, match="does not match its seal"):
        lend.copy_sealed([(files[0][0], files[0][1], targets)], True, stamps)
