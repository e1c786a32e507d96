"""Per-file zstd compression (`dcs_tasks.checkpoint.format.compression`, `zread`): the worker's writer stores the bytes
durably, compressed only when they shrink, with the checksum of the uncompressed bytes; the readers give back
exactly those bytes (whole files, scattered ranges, mixed with plain files), and a damaged or hostile file or
entry is a CorruptCheckpoint naming it, without ever decompressing more than the entry's `size`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import zstandard

from dcs_tasks.checkpoint.format import compression, validate
from dcs_tasks.checkpoint.format.compression import CompressionSpec
from dcs_tasks.checkpoint.format.layout import FileEntry, Manifest, new_hasher
from dcs_tasks.checkpoint.store.reads import fileread, stepcheck, zdecode, zread
from dcs_tasks.checkpoint.store.writes.zwrite import write_region
from dcs_tasks.errors import CorruptCheckpoint

ZSTD = CompressionSpec(codec="zstd", level=3, min_saving=0.05)
NAME = "model-00001-of-00001.safetensors"


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fileread, "CHUNK_BYTES", 65536)  # many steps per file
    monkeypatch.setattr(zread, "CHUNK_BYTES", 65536)


def _staged(tmp_path: Path, data: bytes, offset: int = 4096) -> Path:
    """A staging-like file holding `data` at a page-aligned `offset`."""
    path = tmp_path / "stage"
    path.write_bytes(b"\xee" * offset + data + b"\xee" * 100)
    return path


def _compressible(size: int, seed: int = 0) -> bytes:
    """Small integers in int64 (token ids, counters): zstd shrinks them several times."""
    values = torch.randint(0, 1000, (size // 8,), dtype=torch.int64, generator=torch.Generator().manual_seed(seed))
    return values.numpy().tobytes()


def _random(size: int, seed: int = 1) -> bytes:
    return (
        torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
        .numpy()
        .tobytes()
    )


def _checksum(data: bytes) -> str:
    hasher = new_hasher()
    hasher.update(data)
    return str(hasher.hexdigest())


@pytest.mark.parametrize("threads", [0, 1])
def test_compressible_bytes_are_stored_compressed_with_the_checksum_of_the_plain_bytes(
    tmp_path: Path, threads: int
) -> None:
    data = _compressible(300_000)
    entry = write_region(_staged(tmp_path, data), 4096, len(data), tmp_path / NAME, "t1", ZSTD, threads)
    assert entry.compression == "zstd" and entry.size == len(data) and entry.checksum == _checksum(data)
    stored = tmp_path / (NAME + ".zst")
    assert not (tmp_path / NAME).exists() and entry.stored_path(tmp_path) == stored
    assert entry.stored_size == stored.stat().st_size < len(data) // 2
    assert zstandard.ZstdDecompressor().decompress(stored.read_bytes()) == data
    assert not list(tmp_path.glob(".*.tmp"))  # durable: temp renamed away


def test_bytes_that_do_not_shrink_are_stored_as_they_are(tmp_path: Path) -> None:
    data = _random(2_000_000)
    entry = write_region(_staged(tmp_path, data), 4096, len(data), tmp_path / NAME, "t1", ZSTD)
    assert entry.compression is None and entry.stored_size is None
    assert (tmp_path / NAME).read_bytes() == data and not (tmp_path / (NAME + ".zst")).exists()
    forced = ZSTD.model_copy(update={"min_saving": 0.0})  # 0: always compress
    entry = write_region(_staged(tmp_path, data), 4096, len(data), tmp_path / "b.safetensors", "t2", forced)
    assert entry.compression == "zstd"


def _stored(tmp_path: Path, data: bytes, name: str = NAME) -> tuple[Path, FileEntry]:
    entry = write_region(_staged(tmp_path, data), 4096, len(data), tmp_path / name, "t", ZSTD)
    assert entry.compression == "zstd"
    return entry.stored_path(tmp_path), entry


def test_readers_give_back_the_bytes_of_compressed_and_plain_files_together(tmp_path: Path) -> None:
    packed = [_stored(tmp_path, _compressible(200_000 + i, seed=i), f"c{i}.safetensors") for i in range(3)]
    raw = tmp_path / "plain.safetensors"
    plain_bytes = _random(150_001)
    raw.write_bytes(plain_bytes)
    files = [packed[0], (raw, FileEntry(name=raw.name, size=len(plain_bytes), checksum=_checksum(plain_bytes)))]
    files += packed[1:]
    expected = [
        zstandard.ZstdDecompressor().decompress(p.read_bytes()) if e.compression else plain_bytes for p, e in files
    ]
    seen: dict[str, int] = {}
    mappings = fileread.read_many(files, True, lambda name, done, size: seen.__setitem__(name, done))
    for (_, entry), mapping, data in zip(files, mappings, expected, strict=True):
        assert mapping[: entry.size] == data and seen[entry.name] == entry.size
    spans = [(5, 70_000), (130_000, 130_008), (190_000, 200_000)]  # across steps of 64 KiB, a gap, the tail
    dests = [torch.zeros(end - begin, dtype=torch.uint8) for begin, end in spans]
    targets = [(b, e, d.numpy().data) for (b, e), d in zip(spans, dests, strict=True)]
    fileread.read_scatter([(files[0][0], files[0][1], targets), (raw, files[1][1], [])], True)
    for (begin, end), dest in zip(spans, dests, strict=True):
        assert dest.numpy().tobytes() == expected[0][begin:end]


def _expect_corrupt(path: Path, entry: FileEntry, reason: str) -> None:
    for read in (
        lambda: fileread.read_many([(path, entry)], True),
        lambda: fileread.read_scatter([(path, entry, [])], True),
    ):
        with pytest.raises(CorruptCheckpoint, match=reason) as info:
            read()
        assert str(path) in str(info.value)


def test_damaged_compressed_files_are_named(tmp_path: Path) -> None:
    path, entry = _stored(tmp_path, _compressible(400_000))
    good = path.read_bytes()
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0x5A
    path.write_bytes(bytes(flipped))
    _expect_corrupt(path, entry, "fails its xxh3_128 checksum|not valid zstd|decompresses to")
    path.write_bytes(good[:-50] + b"\0" * 50)  # same size, last block gone
    _expect_corrupt(path, entry, "not valid zstd|decompresses to")
    path.write_bytes(good[:-50])
    _expect_corrupt(path, entry, f"has {len(good) - 50} bytes, manifest says {len(good)}")
    path.write_bytes(b"\0" * len(good))
    _expect_corrupt(path, entry, "does not start with a zstd frame")


def test_a_frame_holding_more_than_the_manifest_size_is_refused_without_decompressing_it(tmp_path: Path) -> None:
    """A bomb: 256 MiB of zeros in ~8 KiB. With its size in the frame header it is refused before any
    decompression; without it, decompression stops after the manifest's size."""
    bomb_size = 256 << 20
    path = tmp_path / (NAME + ".zst")
    for recorded in (True, False):
        stream = zstandard.ZstdCompressor(level=1, write_content_size=recorded).compressobj(
            size=bomb_size if recorded else -1
        )
        zero = bytes(16 << 20)
        path.write_bytes(b"".join(stream.compress(zero) for _ in range(bomb_size // len(zero))) + stream.flush())
        claim = 1 << 20
        entry = FileEntry(name=NAME, size=claim, checksum="0" * 32, compression="zstd", stored_size=path.stat().st_size)
        reason = f"records {bomb_size} bytes, the manifest {claim}" if recorded else "records no size"
        _expect_corrupt(path, entry, reason)
        fd = os.open(path, os.O_RDONLY)
        try:
            decoder = zdecode.Decoder(fd, path, entry)
            decoder.read(claim)  # at most `size` bytes come out, then the frame must end
            with pytest.raises(CorruptCheckpoint, match=f"decompresses to more than the manifest's {claim} bytes"):
                decoder.finish()
            with pytest.raises(CorruptCheckpoint, match="read past"):
                decoder.read(1)
        finally:
            os.close(fd)


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"compression": "lz4", "stored_size": 100}, "has compression 'lz4', not one DCS reads"),
        ({"compression": "zstd"}, "is compressed but records no stored size"),
        ({"stored_size": 100}, "records a stored size but no compression"),
        ({"compression": "zstd", "stored_size": 4}, "cannot hold 1000000 bytes"),
        ({"compression": "zstd", "stored_size": 1_000_000 // 32768}, "cannot hold 1000000 bytes"),
        ({"compression": "zstd", "stored_size": 2_000_000}, "cannot hold 1000000 bytes"),
        # issue 20, finding 5: zstd can expand 32,768x; past 256x is refused before anything is allocated
        ({"compression": "zstd", "stored_size": 1_000_000 // 300}, "at most 256x expansion"),
        ({"compression": "zstd", "stored_size": 1_000_000 // 1000}, "at most 256x expansion"),
    ],
)
def test_hostile_compression_fields_are_refused_before_any_file_is_opened(
    fields: dict[str, object], reason: str
) -> None:
    entry = FileEntry(name=NAME, size=1_000_000, checksum="0" * 32, **fields)  # type: ignore[arg-type]
    assert compression.stored_size_problem(entry) is not None
    assert reason in str(compression.stored_size_problem(entry))


def test_a_real_bomb_that_verifies_is_refused_before_any_allocation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 20, finding 5: 64 MiB of zeros in one well-formed frame (~2 KiB on disk, 32,768x) with a correct
    size, stored size and checksum used to be restored (64 MiB allocated and filled per 2 KiB). Now the entry
    is refused by the manifest check, and no mapping is ever allocated."""
    data = bytes(64 << 20)
    blob = zstandard.ZstdCompressor(level=1, write_checksum=False).compress(data)
    assert len(data) // len(blob) > 10_000
    path = tmp_path / (NAME + ".zst")
    path.write_bytes(blob)
    entry = FileEntry(name=NAME, size=len(data), checksum=_checksum(data), compression="zstd", stored_size=len(blob))
    allocated: list[int] = []
    real = fileread.anonymous

    def spy(size: int) -> Any:
        allocated.append(size)
        return real(size)

    monkeypatch.setattr(fileread, "anonymous", spy)
    monkeypatch.setattr(zread, "anonymous", spy)
    with pytest.raises(CorruptCheckpoint, match="at most 256x expansion"):
        validate.check_manifest(_manifest_of(entry), tmp_path / "manifest.json")  # what every reader runs first
    assert allocated == []


def _manifest_of(entry: FileEntry) -> Manifest:
    return Manifest.model_validate(
        {"run": "r", "step": 1, "created_at": 0.0, "files": [entry.model_dump()], "tensors": {}, "structure": {}}
    )


def test_all_zero_files_are_written_within_the_expansion_limit_and_read_back(tmp_path: Path) -> None:
    """The writer keeps its own output within the limit readers enforce: a file of zeros (x32,768 in one
    frame) is padded with skippable frames to size/256 bytes, and reads back bit-exact and verified."""
    for size in (8 << 20, 100_000, 4097):
        data = bytes(size)
        entry = write_region(_staged(tmp_path, data), 4096, size, tmp_path / NAME, "t", ZSTD)
        stored = entry.stored_path(tmp_path)
        assert entry.compression == "zstd" and entry.stored_size == stored.stat().st_size
        assert entry.stored_size >= size / compression.MAX_EXPANSION
        assert compression.stored_size_problem(entry) is None
        (mapping,) = fileread.read_many([(stored, entry)], True, None)
        assert mapping[:size] == data
        assert zstandard.ZstdDecompressor().decompressobj().decompress(stored.read_bytes()) == data  # zstd's own


def test_hostile_payload_levels_are_refused() -> None:
    from pydantic import ValidationError

    for bad in ({"level": 22}, {"level": -100}, {"level": "3"}, {"codec": "lz4"}, {"min_saving": float("nan")}):
        with pytest.raises(ValidationError):
            CompressionSpec.model_validate(bad)


def test_the_header_of_a_compressed_file_is_checked_by_decompressing_only_the_header(tmp_path: Path) -> None:
    header = b'{"__metadata__":{"format":"pt"},"w":{"dtype":"I64","shape":[2],"data_offsets":[0,16]}}'
    header += b" " * (-(8 + len(header)) % 64)
    data = len(header).to_bytes(8, "little") + header + (7).to_bytes(8, "little") * 2
    entry = FileEntry(
        name=NAME,
        size=len(data),
        checksum=_checksum(data),
        compression="zstd",
        stored_size=0,
    )
    blob = zstandard.ZstdCompressor().compress(data)
    entry = entry.model_copy(update={"stored_size": len(blob)})
    (tmp_path / (NAME + ".zst")).write_bytes(blob)
    fd = stepcheck.open_regular(tmp_path / (NAME + ".zst"))
    try:
        parsed, start = stepcheck.read_header(fd, tmp_path, entry.size, zdecode.Decoder(fd, tmp_path, entry).read)
    finally:
        os.close(fd)
    assert start == 8 + len(header) and parsed["w"]["shape"] == [2]
