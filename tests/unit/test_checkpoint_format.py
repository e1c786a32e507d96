"""Staging layout and state flattening, without services: the staged bytes ARE a safetensors file."""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dcs_tasks.checkpoint.format.layout import DTYPE_CODES, plan_layout, specs_of
from dcs_tasks.checkpoint.save.staging import StagingPool, copy_into
from dcs_tasks.checkpoint.state.structure import flatten_state, unflatten_state
from dcs_tasks.errors import StagingError
from tests.checkpoint_support import as_bytes


def _every_dtype() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out: dict[str, torch.Tensor] = {}
    for dtype in DTYPE_CODES:
        base = torch.randn(5, 7, generator=g) * 50
        out[str(dtype)] = base.to(dtype) if dtype is not torch.bool else base > 0
    out["scalar"] = torch.tensor(3.5)
    out["empty"] = torch.empty(0, 4)
    out["transposed"] = torch.arange(12.0).reshape(3, 4).t()
    out["strided"] = torch.arange(20, dtype=torch.int64)[::3]
    return out


def _stage(tmp_path: Path, tensors: dict[str, torch.Tensor], shard: int) -> tuple[Path, list[tuple[str, int, int]]]:
    layout = plan_layout(specs_of(tensors), shard)
    pool = StagingPool(tmp_path / "shm", 1, "t")
    lease = pool.lease(layout.nbytes)
    assert lease is not None
    buf = lease.buffer
    buf.write_headers(layout)
    copy_into(buf, layout, tensors)
    assert buf.view is not None
    out = []
    for f in layout.files:
        path = tmp_path / f.name
        path.write_bytes(buf.view[f.offset : f.offset + f.size].numpy().tobytes())
        out.append((f.name, f.offset, f.size))
    pool.close()
    return tmp_path, out


def test_staged_bytes_open_with_plain_safetensors_bit_exact(tmp_path: Path) -> None:
    tensors = _every_dtype()
    directory, files = _stage(tmp_path, tensors, shard=1 << 20)
    seen: dict[str, torch.Tensor] = {}
    for name, _, _ in files:
        with safe_open(str(directory / name), framework="pt") as f:
            seen.update({k: f.get_tensor(k) for k in f.keys()})
    assert set(seen) == set(tensors)
    for name, tensor in tensors.items():
        assert seen[name].dtype == tensor.dtype and seen[name].shape == tensor.shape
        assert torch.equal(as_bytes(seen[name]), as_bytes(tensor)), name


def test_layout_splits_into_shards_with_aligned_tensors() -> None:
    tensors = {f"w{i}": torch.zeros(1000 * (i + 1), dtype=torch.float16 if i % 2 else torch.float32) for i in range(6)}
    layout = plan_layout(specs_of(tensors), shard_bytes=10_000)
    assert len(layout.files) >= 3
    assert sum(len(f.slots) for f in layout.files) == 6
    for f in layout.files:
        assert f.offset % 4096 == 0 and f.data_start % 64 == 0
        for slot in f.slots:
            itemsize = 4 if slot.spec.dtype == "F32" else 2
            assert slot.begin % itemsize == 0


def test_structure_round_trip_keeps_types_and_float_bits() -> None:
    opt = torch.optim.AdamW(torch.nn.Linear(3, 2).parameters(), lr=1e-3)
    state = {
        "model": OrderedDict(w=torch.ones(2)),
        "optim": opt.state_dict(),
        "step": 7,
        "values": [1.5, -0.0, math.inf, None, True, "x", (1, 2), torch.Size([2, 3]), torch.bfloat16],
        3: {"nested": [torch.arange(3)]},
    }
    flat = flatten_state(state)
    back = unflatten_state(flat.structure, flat.tensors)
    assert type(back["model"]) is OrderedDict
    assert back["optim"]["param_groups"] == state["optim"]["param_groups"]
    assert back["values"][:3] == [1.5, -0.0, math.inf] and math.copysign(1, back["values"][1]) == -1
    assert back["values"][6] == (1, 2) and back["values"][7] == torch.Size([2, 3])
    assert back["values"][8] is torch.bfloat16
    assert torch.equal(back[3]["nested"][0], torch.arange(3))
    assert back["step"] == 7


def test_unsupported_values_are_refused_not_pickled() -> None:
    with pytest.raises(StagingError, match="object"):
        flatten_state({"bad": object()})


def test_pool_reuses_buffers_and_removes_orphans_of_dead_trainers(tmp_path: Path) -> None:
    directory = tmp_path / "shm"
    directory.mkdir()
    orphan = directory / "t-999999999-deadbeef-0.stage"  # no such pid
    orphan.write_bytes(b"x")
    # live staging of run "t-999999998" (its trainer: this process), not an orphan of run "t"
    other_run = directory / f"t-999999998-{os.getpid()}-deadbeef-0.stage"
    other_run.write_bytes(b"x")
    pool = StagingPool(directory, 2, "t")
    assert not orphan.exists() and other_run.exists()
    other_run.unlink()
    first = pool.lease(10_000)
    second = pool.lease(10_000)
    assert first is not None and second is not None and pool.lease(1) is None  # bounded: 2 buffers
    ptr = first.buffer.view.data_ptr()  # type: ignore[union-attr]
    first.release()
    again = pool.lease(5_000)
    assert again is not None and again.buffer is first.buffer  # same buffer, same mapping
    assert again.buffer.view.data_ptr() == ptr  # type: ignore[union-attr]
    pool.close()
    assert list(directory.iterdir()) == []


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.norm = torch.nn.BatchNorm1d(4)  # state_dict()._metadata carries its version
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight


def test_tied_tensors_are_stored_once_and_come_back_tied_with_module_metadata() -> None:
    import json

    model = _Tied()
    state = {"model": model.state_dict()}
    flat = flatten_state(state)
    assert "model/head.weight" not in flat.tensors and "model/embed.weight" in flat.tensors
    structure = json.loads(json.dumps(flat.structure))  # it travels as JSON in the manifest
    copies = {name: t.clone() for name, t in flat.tensors.items()}
    restored = unflatten_state(structure, copies)["model"]
    assert restored["head.weight"] is restored["embed.weight"]
    assert restored._metadata == model.state_dict()._metadata and restored._metadata["norm"]["version"] == 2
    fresh = _Tied()
    fresh.load_state_dict(restored)
    assert torch.equal(fresh.head.weight, model.embed.weight) and fresh.head.weight is fresh.embed.weight


def test_different_views_of_one_storage_are_not_tied() -> None:
    base = torch.arange(12.0)
    flat = flatten_state({"all": base, "head": base[:4], "reshaped": base.view(3, 4), "again": base})
    assert sorted(flat.tensors) == ["all", "head", "reshaped"]  # "again" is the same view as "all"
