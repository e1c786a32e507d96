"""Colocated updates by CUDA IPC between two processes on one GPU: the trainer (this process) packs a bucket on
cuda:0 and shares it by handle; a second process opens it through DCS's frame (`dcs_tasks/sync/ipcframe.py`)
or through torch's own reductions as SGLang's `MultiprocessingSerializer` does, and reads it on the same device.
An engine that keeps a handle open past the deadline does not keep the trainer's memory: the dropped bucket's
block goes back to the trainer's allocator. Needs CUDA; skipped without it (never run on the CPU-only CI)."""

from __future__ import annotations

import base64
import multiprocessing
import pickle
from typing import Any

import pytest
import torch

from dcs_tasks.backends.fusion import pack_into, sglang_layout
from dcs_tasks.sync.colocated import BucketPool, sglang_payload
from dcs_tasks.sync.ipcframe import decode, frame_for, open_bucket
from dcs_tasks.tensors import TensorSpec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.integration,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch.cuda.is_available() is False)"),
]


def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {
        "w": torch.randn(256, 128, generator=g).cuda(),
        "b": torch.randn(128, generator=g).to(torch.bfloat16).cuda(),
        "ids": torch.arange(77, dtype=torch.int16).cuda(),
    }


def _frame_child(raw: bytes, out: Any, hold: Any) -> None:
    frame = decode(raw)
    with open_bucket(frame) as view:
        assert view.device.type == "cuda"
        out.put(bytes(view.cpu().numpy()))
        hold.wait(60)  # keeps the handle open until told (an engine that does not release)


def _pickle_child(payload: str, out: Any) -> None:
    data = pickle.loads(base64.b64decode(payload))  # what SGLang's SafeUnpickler admits: torch's rebuild functions
    flat = data["flattened_tensor"]
    assert flat.device.type == "cuda"
    out.put((bytes(flat.cpu().numpy()), [(m.name, m.start_idx, m.end_idx) for m in data["metadata"]]))


def packed() -> tuple[BucketPool, Any, torch.Tensor]:
    s = state()
    layout = sglang_layout([TensorSpec.of(k, v) for k, v in s.items()])
    pool = BucketPool(torch.device("cuda:0"), layout.total_bytes)
    view = pack_into(pool.slots[0].tensor, layout, s)
    torch.cuda.synchronize()
    return pool, layout, view


def test_a_second_process_reads_the_bucket_through_dcs_frame_by_cuda_ipc() -> None:
    pool, layout, view = packed()
    frame = frame_for("cuda", 0, 0, layout, 1, True, cuda=pool.slots[0].cuda)
    ctx = multiprocessing.get_context("spawn")
    out, hold = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=_frame_child, args=(frame.encode(), out, hold))
    child.start()
    try:
        assert out.get(timeout=120) == bytes(view.cpu().numpy())
    finally:
        hold.set()
        child.join(60)
    assert child.exitcode == 0


def test_a_second_process_reads_sglang_s_payload_by_cuda_ipc() -> None:
    _pool, layout, view = packed()  # the pool keeps the bucket alive while the child reads it
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=_pickle_child, args=(sglang_payload(view, layout), out))
    child.start()
    try:
        raw, metadata = out.get(timeout=120)
    finally:
        child.join(60)
    assert child.exitcode == 0 and raw == bytes(view.cpu().numpy())
    assert [name for name, _, _ in metadata] == [s.name for s in layout.specs]


def test_a_handle_kept_past_the_deadline_does_not_pin_the_trainer_s_memory() -> None:
    pool, layout, _ = packed()
    frame = frame_for("cuda", 0, 0, layout, 1, True, cuda=pool.slots[0].cuda)
    ctx = multiprocessing.get_context("spawn")
    out, hold = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=_frame_child, args=(frame.encode(), out, hold))
    child.start()
    try:
        out.get(timeout=120)  # the child holds the handle open from here on
        before = torch.cuda.memory_allocated()
        for _ in range(5):  # each drop frees the old block although the child never closed its handle
            pool.drop(0)
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() <= before + pool.bucket_bytes, "dropped buckets were not freed"
    finally:
        hold.set()
        child.join(60)
