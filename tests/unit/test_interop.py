"""Pieces of `dcs_tasks.interop` without Redis: DCP metadata checks, names of a saved state, sizes, prefixes."""

from __future__ import annotations

import pickle
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

from dcs_tasks.checkpoint.state.structure import flatten_state
from dcs_tasks.errors import CheckpointError
from dcs_tasks.interop.foreign import ForeignCheckpointError, _check_tiling, read_dcp_dir, read_dcp_metadata
from dcs_tasks.interop.hf_export import parse_size
from dcs_tasks.interop.names import normalise_prefix, tensor_paths


def saved(tmp_path: Path) -> Path:
    source = tmp_path / "dcp"
    state = {"model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(2)}, "step": 3, "l": [1, 2]}
    dcp.save(state, checkpoint_id=str(source), no_dist=True)
    return source


def rewrite(source: Path, change: Any) -> None:
    """Edit the metadata DCP just wrote in this test (our own file, so pickle.loads is fine here)."""
    metadata = pickle.loads((source / ".metadata").read_bytes())
    change(metadata)
    (source / ".metadata").write_bytes(pickle.dumps(metadata))


def test_real_dcp_metadata_passes_and_reads_back(tmp_path: Path) -> None:
    source = saved(tmp_path)
    assert set(read_dcp_metadata(source).state_dict_metadata) == {"model.w", "model.b", "step", "l"}
    state = read_dcp_dir(source)
    assert torch.equal(state["model"]["w"], torch.arange(12.0).reshape(3, 4)) and state["step"] == 3
    assert state["l"] == [1, 2]


def _chunk(metadata: Any, fqn: str) -> Any:
    return metadata.state_dict_metadata[fqn]


def test_chunks_that_overlap_or_leave_gaps_are_refused(tmp_path: Path) -> None:
    source = saved(tmp_path)

    def overlap(metadata: Any) -> None:  # two chunks covering the same rows: volumes add up, yet they overlap
        md = _chunk(metadata, "model.w")
        md.chunks = [
            ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 4])),
            ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([1, 4])),
        ]

    rewrite(source, overlap)
    with pytest.raises(ForeignCheckpointError, match=r"two chunks of tensor 'model\.w' overlap"):
        read_dcp_metadata(source)

    source = saved(tmp_path / "gap")
    rewrite(source, lambda m: setattr(_chunk(m, "model.w"), "size", torch.Size([4, 4])))
    with pytest.raises(ForeignCheckpointError, match=r"chunks of tensor 'model\.w' do not cover it"):
        read_dcp_metadata(source)


def _grid(rows: int, cols: int, step: int = 4) -> list[tuple[list[int], list[int]]]:
    return [([r * step, c * step], [step, step]) for r in range(rows) for c in range(cols)]


def test_the_tiling_check_is_linear_in_the_chunks() -> None:
    """Issue 20, finding 4: a pairwise overlap test made 4096 chunks of one tensor cost ~17 CPU-s, so a small
    `.metadata` listing many such tensors held the import for minutes before refusing it. 16 tensors of 4096
    chunks each (a 64 x 64 grid, and a 1-D split) are now checked in well under a second each."""
    where = Path("x/.metadata")
    started = time.process_time()
    for _ in range(8):
        _check_tiling("t", [256, 256], _grid(64, 64), where)
        _check_tiling("v", [4096 * 3], [([i * 3], [3]) for i in range(4096)][::-1], where)
    assert time.process_time() - started < 8.0
    overlapping = _grid(64, 64)
    overlapping[-1] = ([1, 1], [4, 4])  # the same volume, moved onto its neighbours
    with pytest.raises(ForeignCheckpointError, match=r"two chunks of tensor 't' overlap"):
        _check_tiling("t", [256, 256], overlapping, where)


def test_an_exact_tiling_that_is_no_grid_passes_and_a_too_irregular_one_is_refused() -> None:
    where = Path("x/.metadata")
    bricks = [([r, 0], [1, 1 + r]) for r in range(8)] + [([r, 1 + r], [1, 15 - r]) for r in range(8)]  # 8 x 16
    _check_tiling("w", [8, 16], bricks, where)
    bricks[-1] = ([7, 7], [1, 8])  # the last brick shifted left by one column: same volume, overlaps its row's first
    with pytest.raises(ForeignCheckpointError, match="overlap"):
        _check_tiling("w", [8, 16], bricks, where)
    n = 3000
    stairs = [([i, 0], [1, i + 1]) for i in range(n)] + [([i, i + 1], [1, n - i]) for i in range(n)]
    with pytest.raises(ForeignCheckpointError, match="too irregular a layout to check"):
        _check_tiling("s", [n, n + 1], stairs, where)


def test_a_small_metadata_file_cannot_claim_more_bytes_than_the_files_hold(tmp_path: Path) -> None:
    source = saved(tmp_path)

    def huge(metadata: Any) -> None:
        md = _chunk(metadata, "model.w")
        md.size = torch.Size([1 << 20, 1 << 20])
        md.chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([1 << 20, 1 << 20]))]

    rewrite(source, huge)
    with pytest.raises(ForeignCheckpointError, match="more bytes than its files"):
        read_dcp_metadata(source)


def test_storage_outside_the_files_and_transforms_are_refused(tmp_path: Path) -> None:
    source = saved(tmp_path)

    def beyond(metadata: Any) -> None:
        for info in metadata.storage_data.values():
            info.offset = 1 << 30

    rewrite(source, beyond)
    with pytest.raises(ForeignCheckpointError, match="lies outside the file"):
        read_dcp_metadata(source)

    source = saved(tmp_path / "t")

    def compressed(metadata: Any) -> None:
        for info in metadata.storage_data.values():
            info.transform_descriptors = ["zstd"]

    rewrite(source, compressed)
    with pytest.raises(ForeignCheckpointError, match="transformed"):
        read_dcp_metadata(source)


def test_a_pickle_naming_anything_but_dcp_metadata_is_refused_by_name(tmp_path: Path) -> None:
    source = saved(tmp_path)
    (source / ".metadata").write_bytes(pickle.dumps(Path("/etc/passwd").read_text))  # a bound method
    with pytest.raises(ForeignCheckpointError, match=r"refers to builtins\.getattr, which is not DCP metadata"):
        read_dcp_metadata(source)
    (source / ".metadata").write_bytes(b"\x80\x04not a pickle")
    with pytest.raises(ForeignCheckpointError, match="is not DCP metadata"):
        read_dcp_metadata(source)


def test_tensor_paths_list_every_key_of_a_tied_tensor_in_state_order() -> None:
    embed = torch.ones(4, 2)
    state = {"model": {"embed.weight": embed, "norm": torch.ones(2), "head.weight": embed}, "optim": [torch.ones(1)]}
    paths = tensor_paths(flatten_state(state).structure)
    assert [(p.path, p.stored) for p in paths] == [
        ("model/embed.weight", "model/embed.weight"),
        ("model/norm", "model/norm"),
        ("model/head.weight", "model/embed.weight"),
        ("optim/0", "optim/0"),
    ]


def test_sizes_and_prefixes() -> None:
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size("100") == 100
    assert parse_size("40kb") == 40_000
    for bad in ("", "0", "-1GB", "5 parsecs", "1.5GB"):
        with pytest.raises(CheckpointError, match="not a positive size"):
            parse_size(bad)
    assert normalise_prefix("model") == "model/" and normalise_prefix("") == "" and normalise_prefix("a/b/") == "a/b/"
    with pytest.raises(CheckpointError, match="state keys joined by"):
        normalise_prefix("/abs")
