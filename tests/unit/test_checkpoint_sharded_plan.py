"""Pure resharding arithmetic: tensor_split ranges and the source pieces that cover them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dcs_tasks.checkpoint.format.layout import Manifest, TensorEntry
from dcs_tasks.checkpoint.restore import boxread
from dcs_tasks.checkpoint.restore.sharded import StepShards, _overlaps, _tensor_split_range, plan_reshard
from dcs_tasks.errors import CorruptCheckpoint


def test_split_range_matches_torch_tensor_split() -> None:
    for total in range(0, 23):
        for parts in range(1, 9):
            rows = torch.arange(total)
            for index, part in enumerate(torch.tensor_split(rows, parts)):
                start, length = _tensor_split_range(total, parts, index)
                assert torch.equal(rows[start : start + length], part), (total, parts, index)


def test_overlaps_cover_exactly_the_wanted_rows() -> None:
    sizes = [3, 3, 0, 2, 2]  # uneven shards, one empty
    rows = torch.arange(sum(sizes))
    shards = list(rows.split(sizes))
    for begin in range(len(rows)):
        for length in range(len(rows) - begin + 1):
            pieces = _overlaps(sizes, begin, length)
            got = torch.cat([shards[src][start : start + n] for src, start, n in pieces]) if pieces else rows[:0]
            assert torch.equal(got, rows[begin : begin + length])
            assert all(n > 0 for _, _, n in pieces)


def _split_step(sizes: list[int], dim: int, cols: int = 3) -> StepShards:
    """A step of len(sizes) ranks holding "w" split along `dim` (rank r's part `sizes[r]` long) and a rank-local
    "rng", as manifests only (no files: planning reads none)."""
    manifests = {}
    for rank, size in enumerate(sizes):
        shape = [size, cols] if dim == 0 else [cols, size]
        tensors = {
            "w": TensorEntry(file="shard-00000.safetensors", dtype="F32", shape=shape, offsets=(0, 4 * size * cols)),
            "rng": TensorEntry(file="shard-00000.safetensors", dtype="I64", shape=[2], offsets=(0, 16)),
        }
        manifests[rank] = Manifest(
            run="r",
            step=7,
            tensors=tensors,
            structure={},
            created_at=0.0,
            rank=rank,
            world_size=len(sizes),
            sharded_dims={"w": dim},
            files=[],
        )
    return StepShards(7, len(sizes), {r: Path(f"/nowhere/rank-{r}") for r in manifests}, manifests)


def test_sharding_plan_and_dtensor_catalog_cut_split_tensors_alike() -> None:
    """`sharding=` restores (whole-file reads, `plan_reshard`) and range restores (the DTensor catalog's boxes)
    cut a split tensor with the same function: for uneven splits, both give each rank exactly the rows
    `torch.tensor_split` gives it, from the same source rows."""
    for sizes in ([3, 3, 2, 2], [1, 0, 4], [5], [0, 2, 0]):
        for dim in (0, 1):
            shards = _split_step(sizes, dim)
            total = sum(sizes)
            rows = torch.arange(total)
            sources = list(rows.split(sizes))
            for world in range(1, 7):
                for rank, expected in enumerate(torch.tensor_split(rows, world)):
                    reshard = plan_reshard(shards, rank, world)
                    local = rank if rank < len(sizes) else 0
                    cat = boxread.catalog(shards, local)
                    assert cat.shapes["w"] == ((total, 3) if dim == 0 else (3, total))
                    lo, hi = boxread.default_box(cat, "w", rank, world)
                    assert torch.equal(rows[lo[dim] : hi[dim]], expected), (sizes, dim, world, rank)
                    assert (lo[1 - dim], hi[1 - dim]) == (0, 3)  # the other dimension whole
                    got = [sources[src][start : start + n] for src, start, n in reshard.pieces["w"]]
                    assert torch.equal(torch.cat(got) if got else rows[:0], expected), (sizes, dim, world, rank)
                    # the catalog's pieces sit where plan_reshard's sources do along the split dimension
                    offsets = {p.src: p.offset[dim] for p in cat.pieces["w"]}
                    for src, start, n in reshard.pieces["w"]:
                        assert lo[dim] <= offsets[src] + start < offsets[src] + start + n <= hi[dim]
                    assert reshard.dims == {"w": dim}
                    assert set(reshard.sources) == {local} | {src for src, _, _ in reshard.pieces["w"]}


def test_split_tensors_refuse_ranks_that_do_not_line_up() -> None:
    shards = _split_step([2, 2], 0)
    bad = shards.manifests[1].model_copy(update={"sharded_dims": {"w": 1}})
    broken = StepShards(7, 2, shards.dirs, {0: shards.manifests[0], 1: bad})
    with pytest.raises(CorruptCheckpoint, match="rank 1 does not hold 'w' sharded along dim 0"):
        plan_reshard(broken, 0, 1)
    with pytest.raises(CorruptCheckpoint, match="rank 1 does not hold 'w' sharded along dim 0"):
        boxread.catalog(broken, 0)
