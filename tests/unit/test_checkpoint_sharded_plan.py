"""Pure resharding arithmetic: tensor_split ranges and the source pieces that cover them."""

from __future__ import annotations

import torch

from dcs_tasks.checkpoint.sharded import _overlaps, _tensor_split_range


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
