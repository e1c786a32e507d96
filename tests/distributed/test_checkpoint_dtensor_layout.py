"""The pure pieces of DTensor checkpoints, against brute force and torch itself (no process group needed):
where `torch.chunk` puts shards, which checksum chunks a box of a row-major tensor touches, who writes a
replicated shard, and the checks a manifest's DTensor and chunk-checksum fields get as untrusted input."""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from dcs_tasks.checkpoint.format import validate
from dcs_tasks.checkpoint.format.layout import ChunkSums, FileEntry, Manifest, ShardEntry, TensorEntry
from dcs_tasks.checkpoint.restore import boxread
from dcs_tasks.checkpoint.state.structure import check_structure, unflatten_state
from dcs_tasks.errors import CorruptCheckpoint

FILE = "model-00001-of-00001.safetensors"


@pytest.mark.parametrize("size", [0, 1, 7, 10, 16, 17, 4099])
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 8])
def test_chunk_range_is_where_torch_chunk_puts_each_piece(size: int, parts: int) -> None:
    pieces = torch.chunk(torch.arange(size), parts) if size else ()
    for index in range(parts):
        start, length = boxread.chunk_range(size, parts, index)
        expected = pieces[index].tolist() if index < len(pieces) else []
        assert list(range(start, start + length)) == expected, (size, parts, index)


def _touched(shape: tuple[int, ...], itemsize: int, lo: tuple[int, ...], hi: tuple[int, ...], chunk: int) -> set[int]:
    strides = [itemsize * int(torch.tensor(shape[d + 1 :]).prod()) for d in range(len(shape))]
    out = set()
    for index in itertools.product(*(range(a, b) for a, b in zip(lo, hi, strict=True))):
        byte = sum(i * s for i, s in zip(index, strides, strict=True))
        out.update(range(byte // chunk, (byte + itemsize - 1) // chunk + 1))
    return out


def test_needed_runs_cover_exactly_the_chunks_a_box_touches() -> None:
    rng = random.Random(7)
    for _ in range(300):
        shape = tuple(rng.randint(1, 6) for _ in range(rng.randint(1, 3)))
        itemsize, chunk = rng.choice([1, 2, 4, 8]), rng.choice([8, 16, 24, 64])
        lo = tuple(rng.randint(0, s - 1) for s in shape)
        hi = tuple(rng.randint(a + 1, s) for a, s in zip(lo, shape, strict=True))
        runs = boxread.needed_runs(shape, itemsize, lo, hi, chunk)
        got = {c for a, b in runs for c in range(a, b)}
        assert got == _touched(shape, itemsize, lo, hi, chunk), (shape, itemsize, lo, hi, chunk, runs)
        assert all(b0 < a1 for (_, b0), (a1, _) in itertools.pairwise(runs))  # merged and ordered


def test_a_dim0_box_is_one_contiguous_run() -> None:
    runs = boxread.needed_runs((4096, 256), 4, (1000, 0), (3000, 256), 256 * 1024)
    assert runs == [(1000 * 1024 // (256 * 1024), -(-3000 * 1024 // (256 * 1024)))]


def _meta(shape: tuple[int, ...], mesh: tuple[int, ...], coordinate: tuple[int, ...], dims: Any) -> Any:
    local, offset = boxread.box_of(shape, mesh, coordinate, dims)
    ranks = tuple(range(int(torch.tensor(mesh).prod())))
    names = tuple("R" if d is None else f"S({d})" for d in dims)
    return boxread.ShardMeta(shape, offset, local, names, tuple(dims), mesh, ranks, coordinate, 4)


def test_owners_agree_across_ranks_and_spread_replicas() -> None:
    layouts = {"a": (None,), "b": (None,), "c": (None,), "w": (0,)}
    shapes = {"a": (1000,), "b": (1000,), "c": (1000,), "w": (4099, 8)}
    per_rank = [boxread.assign_owners({n: _meta(shapes[n], (4,), (r,), layouts[n]) for n in layouts}) for r in range(4)]
    for name in ("a", "b", "c"):  # replicated: one writer, the same on every rank
        assert len({owners[name] for owners in per_rank}) == 1
    assert len({per_rank[0][n] for n in ("a", "b", "c")}) == 3  # three replicas, three different ranks
    assert [owners["w"] for owners in per_rank] == [0, 1, 2, 3]  # sharded: each rank its own


def test_2d_replicated_mesh_dimension_has_one_writer_per_shard() -> None:
    dims = (0, None)  # Shard(0) over mesh dim 0, replicated over mesh dim 1
    owners = {
        c: boxread.assign_owners({"t": _meta((10, 3), (2, 2), c, dims)})["t"]
        for c in itertools.product(range(2), range(2))
    }
    assert owners[(0, 0)] == owners[(0, 1)] in (0, 1)
    assert owners[(1, 0)] == owners[(1, 1)] in (2, 3)


def _manifest(**changes: Any) -> Manifest:
    values: dict[str, Any] = {
        "run": "r",
        "step": 1,
        "created_at": 0.0,
        "files": [FileEntry(name=FILE, size=144, checksum="0" * 32)],
        "tensors": {"w": TensorEntry(file=FILE, dtype="F32", shape=[4, 4], offsets=(80, 144))},
        "structure": {"k": "dtensor", "name": "w"},
    }
    values.update(changes)
    return Manifest(**values)


SHARD = {"global_shape": [8, 4], "offset": [4, 0], "placements": ["S(0)"], "mesh_shape": [2]}


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"dtensors": {"x": ShardEntry(**SHARD)}}, "DTensor shard 'x' is not a tensor"),
        ({"dtensors": {"w": ShardEntry(**{**SHARD, "offset": [5, 0]})}}, "lies outside"),
        ({"dtensors": {"w": ShardEntry(**{**SHARD, "offset": [-1, 0]})}}, "lies outside"),
        ({"dtensors": {"w": ShardEntry(**{**SHARD, "global_shape": [8]})}}, "is not 2-D"),
        ({"dtensors": {"w": ShardEntry(**{**SHARD, "placements": ["S(0)", "R"]})}}, "placements and mesh"),
        ({"chunks": ChunkSums(chunk_bytes=4096, sums={"w": []})}, "needs 1 well-formed chunk checksums"),
        ({"chunks": ChunkSums(chunk_bytes=4096, sums={"w": ["zz" * 8]})}, "needs 1 well-formed"),
        ({"chunks": ChunkSums(chunk_bytes=100, sums={"w": ["0" * 16]})}, "100-byte chunks"),
        ({"chunks": ChunkSums(chunk_bytes=4096, sums={"v": ["0" * 16]})}, "'v', which is not a tensor"),
    ],
)
def test_hostile_dtensor_fields_are_refused(changes: dict[str, Any], reason: str) -> None:
    with pytest.raises(CorruptCheckpoint, match=reason):
        validate.check_manifest(_manifest(**changes), Path("manifest.json"))


def test_consistent_dtensor_fields_pass_and_a_dtensor_node_may_name_another_ranks_tensor() -> None:
    manifest = _manifest(
        dtensors={"w": ShardEntry(**SHARD)}, chunks=ChunkSums(chunk_bytes=4096, sums={"w": ["0" * 16]})
    )
    validate.check_manifest(manifest, Path("manifest.json"))
    check_structure({"k": "dtensor", "name": "held-elsewhere"}, ["w"])  # another rank wrote that shard
    with pytest.raises(CorruptCheckpoint, match="names tensor 'held-elsewhere'"):
        unflatten_state({"k": "dtensor", "name": "held-elsewhere"}, {"w": torch.zeros(1)})
