"""DCS's colocated-update frame (dcs_tasks/sync/ipcframe.py) and the topology's colocation entry
(dcs_tasks/sync/colocated.py): what a receiver or a trainer refuses, by name, before touching any memory."""

from __future__ import annotations

import json
import multiprocessing
import re
from typing import Any

import pytest
import torch

from dcs_tasks.backends.fusion import pack_into, sglang_layout
from dcs_tasks.sync.colocated import (
    BucketPool,
    ColocationInvalid,
    colocation_metadata,
    colocation_of,
    host_id,
    is_colocated,
)
from dcs_tasks.sync.ipcframe import MAX_FRAME_BYTES, IpcFrameInvalid, decode, frame_for, open_bucket
from dcs_tasks.tensors import TensorSpec


def good() -> dict[str, Any]:
    return {
        "format": "dcs-ipc-frame", "v": 1, "kind": "shm", "bucket": 0, "generation": 0, "nbytes": 24,
        "names": ["w", "b"], "dtypes": ["float32", "bfloat16"], "shapes": [[2, 2], [4]], "weight_version": 3,
        "last": False, "shm": {"name": "/torch_1_2_3", "offset": 64}, "cuda": None,
    }  # fmt: skip


def test_a_well_formed_frame_decodes_to_its_layout() -> None:
    frame = decode(json.dumps(good()))
    assert frame.layout().names == ["w", "b"] and frame.layout().offsets == (0, 16)
    assert decode(frame.encode()) == frame


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"pickle": "gASV"}, "unknown fields ['pickle']"),
        ({"format": "pickle"}, "this receiver reads dcs-ipc-frame v1"),
        ({"kind": "fd"}, "kind must be 'shm' or 'cuda'"),
        ({"nbytes": 25}, "nbytes=25, its tensors take 24"),
        ({"nbytes": -1}, "'nbytes' must be an integer"),
        ({"bucket": True}, "'bucket' must be an integer"),
        ({"dtypes": ["float32", "object"]}, "frame tensors"),
        ({"shapes": [[2, 2], [-4]]}, "non-negative integers"),
        ({"names": ["w"]}, "same length"),
        ({"last": 1}, "'last' must be a boolean"),
        ({"shm": {"name": "/../../etc/passwd", "offset": 0}}, "not a torch shared-memory file name"),
        ({"shm": {"name": "/torch_1_2_3", "offset": 0, "addr": 1}}, "unknown fields ['addr']"),
        ({"cuda": {"device": 0}}, "a shm frame has cuda: null"),
        ({"weight_version": 0}, "'weight_version' must be an integer"),
    ],
)
def test_a_frame_that_is_not_dcs_s_is_refused_by_name(change: dict[str, Any], message: str) -> None:
    with pytest.raises(IpcFrameInvalid, match=re.escape(message)):
        decode(json.dumps(good() | change))


def test_oversized_or_non_json_frames_are_refused_before_parsing() -> None:
    with pytest.raises(IpcFrameInvalid, match="over"):
        decode(b" " * (MAX_FRAME_BYTES + 1))
    with pytest.raises(IpcFrameInvalid, match="not JSON"):
        decode(b"\x80\x04\x95")  # a pickle's first bytes


def test_a_cuda_frame_is_checked_field_by_field() -> None:
    cuda = {"device": 0, "handle": "zz", "storage_bytes": 64, "storage_offset": 0, "ref_counter": "",
            "ref_counter_offset": 0, "event": ""}  # fmt: skip
    with pytest.raises(IpcFrameInvalid, match=r"cuda\.handle must be hex"):
        decode(json.dumps(good() | {"kind": "cuda", "shm": None, "cuda": cuda}))


def _read_in_child(raw: bytes, out: Any) -> None:
    frame = decode(raw)
    with open_bucket(frame) as view:
        out.put(bytes(view.numpy()))


def test_another_process_reads_the_trainer_s_bucket_through_the_frame() -> None:
    state = {"w": torch.randn(3, 5), "b": torch.arange(6, dtype=torch.int16)}
    layout = sglang_layout([TensorSpec.of(k, v) for k, v in state.items()])
    pool = BucketPool(torch.device("cpu"), layout.total_bytes)
    view = pack_into(pool.slots[0].tensor, layout, state)
    frame = frame_for("shm", 0, 0, layout, 1, True, shm=pool.slots[0].shm)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=_read_in_child, args=(frame.encode(), out))
    child.start()
    try:
        assert out.get(timeout=120) == bytes(view.numpy())
    finally:
        child.join(30)
    assert child.exitcode == 0


def test_colocation_entries_are_validated_and_bounded() -> None:
    entry = colocation_metadata(2, "cpu")["colocated"]
    assert colocation_of({"colocated": entry}, "rollout_0") is not None
    assert colocation_of({}, "rollout_0") is None
    for bad in (
        entry | {"trainer_rank": -1},
        entry | {"trainer_rank": 1 << 20},
        entry | {"trainer_rank": "0"},
        entry | {"device": "cuda:0; rm"},
        entry | {"host_id": "x" * 200},
        entry | {"extra": 1},
        "rank 0",
    ):
        with pytest.raises(ColocationInvalid, match="rollout_7"):
            colocation_of({"colocated": bad}, "rollout_7")


def test_only_the_same_rank_device_and_host_are_colocated() -> None:
    cpu = torch.device("cpu")
    meta = colocation_metadata(0, "cpu")
    assert is_colocated(meta, "e", 0, cpu)
    assert not is_colocated(meta, "e", 1, cpu)
    assert not is_colocated(colocation_metadata(0, "cuda:0"), "e", 0, cpu)
    elsewhere = {"colocated": meta["colocated"] | {"host_id": "0" * 36 if host_id() != "0" * 36 else "1" * 36}}
    assert not is_colocated(elsewhere, "e", 0, cpu), "another machine claiming the same device is remote"
    assert not is_colocated({}, "e", 0, cpu)


def test_engine_attach_registers_colocated_sglang_and_vllm_engines() -> None:
    import argparse

    from dcs_tasks.cli.engine import _colocated

    entry = _colocated(argparse.Namespace(colocated_with=3, colocated_device="cuda:1", kind="sglang"))
    assert entry is not None and colocation_of(entry, "e") == colocation_of(colocation_metadata(3, "cuda:1"), "e")
    assert _colocated(argparse.Namespace(colocated_with=None, colocated_device="cuda:0", kind="vllm")) is None
    vllm = _colocated(argparse.Namespace(colocated_with=0, colocated_device="cpu", kind="vllm"))
    assert vllm is not None and colocation_of(vllm, "e") == colocation_of(colocation_metadata(0, "cpu"), "e")
    with pytest.raises(ColocationInvalid):
        _colocated(argparse.Namespace(colocated_with=0, colocated_device="gpu0", kind="sglang"))


def test_a_dropped_bucket_s_file_goes_although_an_engine_never_took_its_payload() -> None:
    """SGLang's payload counts one reference per pickle, released by the engine's unpickle; an engine that never
    unpickles it would keep the file (the trainer's memory) forever. Dropping the bucket forgets those."""
    import os

    from dcs_tasks.sync.colocated import sglang_payload

    state = {"w": torch.randn(64)}
    layout = sglang_layout([TensorSpec.of(k, v) for k, v in state.items()])
    pool = BucketPool(torch.device("cpu"), layout.total_bytes)
    view = pack_into(pool.slots[0].tensor, layout, state)
    for _ in range(3):
        sglang_payload(view, layout)  # handed out, never unpickled
    shm = pool.slots[0].shm
    assert shm is not None and os.path.exists("/dev/shm" + shm.name)
    del view
    pool.drop(0)
    assert not os.path.exists("/dev/shm" + shm.name)
    assert pool.slots[0].shm is not None and pool.slots[0].shm.name != shm.name and pool.slots[0].generation == 1


def test_a_colocated_vllm_engine_must_run_the_plugin_s_ipc_transport() -> None:
    from dcs_tasks.errors import VLLMBackendMismatch
    from dcs_tasks.sync import vllm_protocol
    from dcs_tasks.sync.wire import EngineEndpoint

    engine = EngineEndpoint(rank=2, ip="127.0.0.1", port=8100, kind="vllm")

    def info(backend: str) -> dict[str, object]:
        return {"vllm_config": {"weight_transfer_config": {"backend": backend}}}

    vllm_protocol.check_backend(engine, info("dcs-ipc"), colocated=True)
    vllm_protocol.check_backend(engine, info("dcs"))
    with pytest.raises(VLLMBackendMismatch, match="'dcs', not 'dcs-ipc' for a colocated engine") as exc:
        vllm_protocol.check_backend(engine, info("dcs"), colocated=True)
    assert """--weight-transfer-config '{"backend": "dcs-ipc"}'""" in str(exc.value)
    with pytest.raises(VLLMBackendMismatch, match="'dcs-ipc', not 'dcs' for a remote engine") as exc:
        vllm_protocol.check_backend(engine, info("dcs-ipc"))
    assert """--weight-transfer-config '{"backend": "dcs"}'""" in str(exc.value)
    with pytest.raises(VLLMBackendMismatch, match="'ipc', not 'dcs-ipc'"):  # vLLM's own ipc engine: pickle
        vllm_protocol.check_backend(engine, info("ipc"), colocated=True)
