"""The vLLM plugin's own reader of DCS's colocated-update frame (plugins/vllm-dcs/vllm_dcs/ipcframe.py; the
plugin has no DCS dependency) agrees with DCS's (dcs_tasks/sync/ipcframe.py): it reads what DCS's trainer
writes to the same layout, and refuses the same bad frames, before any memory is opened."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from dcs_tasks.backends.fusion import pack_into, sglang_layout
from dcs_tasks.sync import ipcframe as dcs_frame
from dcs_tasks.sync.colocated import BucketPool
from dcs_tasks.tensors import TensorSpec

PLUGIN_FRAME = Path(__file__).resolve().parents[2] / "plugins" / "vllm-dcs" / "vllm_dcs" / "ipcframe.py"


@pytest.fixture(scope="module")
def plugin() -> Iterator[ModuleType]:
    spec = importlib.util.spec_from_file_location("vllm_dcs_ipcframe_under_test", PLUGIN_FRAME)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def good() -> dict[str, Any]:
    return {
        "format": "dcs-ipc-frame", "v": 1, "kind": "shm", "bucket": 0, "generation": 0, "nbytes": 24,
        "names": ["w", "b"], "dtypes": ["float32", "bfloat16"], "shapes": [[2, 2], [4]], "weight_version": 3,
        "last": False, "shm": {"name": "/torch_1_2_3", "offset": 64}, "cuda": None,
    }  # fmt: skip


def test_the_plugin_reads_what_dcs_writes_from_the_trainer_s_shared_bucket(plugin: ModuleType) -> None:
    state = {
        "a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "b": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
        "c": torch.tensor([7, 8, 9], dtype=torch.int16),
        "d": torch.tensor([0.25], dtype=torch.float64),
    }
    layout = sglang_layout([TensorSpec.of(n, t) for n, t in state.items()])
    pool = BucketPool(torch.device("cpu"), layout.total_bytes)
    slot = pool.slots[0]
    pack_into(slot.tensor, layout, state)
    frame = dcs_frame.frame_for("shm", 0, slot.generation, layout, 5, True, slot.shm)
    ours = plugin.decode(frame.encode())
    assert ours.names == tuple(layout.names) and ours.offsets == tuple(layout.offsets)
    assert ours.nbytes == layout.wire_bytes and ours.weight_version == 5 and ours.last is True
    with plugin.open_bucket(ours, torch.device("cpu")) as bucket:
        for name, dtype, shape, at in zip(ours.names, ours.dtypes, ours.shapes, ours.offsets, strict=True):
            got = bucket[at : at + state[name].numel() * dtype.itemsize].view(dtype).reshape(shape)
            assert torch.equal(got.view(torch.uint8), state[name].view(torch.uint8))


@pytest.mark.parametrize(
    "change",
    [
        {"pickle": "gASV"},
        {"format": "pickle"},
        {"kind": "fd"},
        {"nbytes": 25},
        {"nbytes": 23},
        {"nbytes": -1},
        {"bucket": True},
        {"dtypes": ["float32", "object"]},
        {"dtypes": ["float32", "__class__"]},
        {"shapes": [[2, 2], [-4]]},
        {"names": ["w"]},
        {"last": 1},
        {"shm": {"name": "/../../etc/passwd", "offset": 0}},
        {"shm": {"name": "/torch_1_2_3", "offset": 0, "addr": 1}},
        {"cuda": {"device": 0}},
        {"weight_version": 0},
        {"names": ["b", "w"], "dtypes": ["bfloat16", "float32"], "shapes": [[1], [5]], "nbytes": 22},
    ],
)
def test_the_plugin_refuses_every_frame_dcs_refuses(plugin: ModuleType, change: dict[str, Any]) -> None:
    raw = json.dumps(good() | change)
    with pytest.raises(dcs_frame.IpcFrameInvalid):
        dcs_frame.decode(raw)
    with pytest.raises(plugin.FrameInvalid):
        plugin.decode(raw)


def test_the_plugin_opens_no_file_a_frame_names_outside_torch_s_shared_memory(plugin: ModuleType) -> None:
    missing = good() | {"shm": {"name": "/torch_999999_0_0", "offset": 64}}
    with pytest.raises(plugin.FrameInvalid, match="cannot be opened"):
        with plugin.open_bucket(plugin.from_json(missing), torch.device("cpu")):
            pass
    with pytest.raises(plugin.FrameInvalid, match="not JSON"):
        plugin.decode(b"\x80\x04\x95")
