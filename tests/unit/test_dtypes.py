"""The one dtype table and `TensorSpec` (dcs_tasks/tensors.py), checked against safetensors itself: every
checkpointable dtype's code is the one safetensors writes and reads back bit-exact, every table dtype fuses and
unfuses bit-exact for weight sync, and what a path cannot carry is an `UnsupportedDtype` naming tensor and dtype."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save, save_file

from dcs_tasks.backends.fusion import FusionLayout, TensorFusion
from dcs_tasks.checkpoint.format.layout import plan_layout, specs_of
from dcs_tasks.checkpoint.save.staging import StagingPool, copy_into
from dcs_tasks.errors import InvalidTensorSpec, UnsupportedDtype
from dcs_tasks.sync.receive_checks import tensor_bytes
from dcs_tasks.tensors import (
    CODE_DTYPES,
    DTYPE_CODES,
    DTYPES,
    DtypeInfo,
    TensorSpec,
    checkpoint_code,
    info_coded,
    info_named,
    info_of,
    parse_dtype,
)

CHECKPOINTED = [row for row in DTYPES if row.code is not None]
BRIEFED = [  # the dtypes this table was made to settle, by DCS name
    "float8_e4m3fn",
    "float8_e5m2",
    "uint16",
    "uint32",
    "uint64",
    "complex64",
    "complex128",
    "bool",
]


def _random(dtype: torch.dtype, n: int = 9) -> torch.Tensor:
    """Random bytes viewed as `dtype` (bool: 0/1 only, the only bytes a bool may hold)."""
    if dtype is torch.bool:
        return torch.rand(n, generator=torch.Generator().manual_seed(1)) > 0.5
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    return raw.view(dtype)


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_every_row_is_consistent_with_torch() -> None:
    assert len({row.name for row in DTYPES}) == len({row.torch_dtype for row in DTYPES}) == len(DTYPES)
    for row in DTYPES:
        assert str(row.torch_dtype) == f"torch.{row.name}"
        assert row.itemsize == torch.empty((), dtype=row.torch_dtype).element_size()
        assert info_of(row.torch_dtype) is info_named(row.name) is info_named(f"torch.{row.name}")
        assert parse_dtype(row.name) is row.torch_dtype
    assert set(BRIEFED) <= {row.name for row in DTYPES}
    assert DTYPE_CODES == {row.torch_dtype: row.code for row in CHECKPOINTED}
    assert CODE_DTYPES == {row.code: row.torch_dtype for row in CHECKPOINTED}


@pytest.mark.parametrize("row", CHECKPOINTED, ids=lambda row: row.name)
def test_the_code_is_what_safetensors_writes_and_reads_back(row: DtypeInfo) -> None:
    tensor = _random(row.torch_dtype)
    blob = save({"t": tensor})
    (length,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + length])
    assert header["t"]["dtype"] == row.code
    assert info_coded(header["t"]["dtype"]) is row


@pytest.mark.parametrize("row", CHECKPOINTED, ids=lambda row: row.name)
def test_dcs_staged_files_open_with_safetensors_bit_exact(row: DtypeInfo, tmp_path: Path) -> None:
    tensors = {"t": _random(row.torch_dtype, 33).view(3, 11), "s": _random(row.torch_dtype, 1).view(())}
    layout = plan_layout(specs_of(tensors), 1 << 20)
    pool = StagingPool(tmp_path / "shm", 1, "t")
    try:
        lease = pool.lease(layout.nbytes)
        assert lease is not None
        buf = lease.buffer
        assert buf.view is not None
        buf.write_headers(layout)
        copy_into(buf, layout, tensors)
        (f,) = layout.files
        (tmp_path / f.name).write_bytes(buf.view[f.offset : f.offset + f.size].numpy().tobytes())
    finally:
        pool.close()
    with safe_open(str(tmp_path / f.name), framework="pt") as opened:
        for name, tensor in tensors.items():
            back = opened.get_tensor(name)
            assert back.dtype == tensor.dtype and back.shape == tensor.shape
            assert _bits(back) == _bits(tensor), name


def test_complex128_syncs_but_is_refused_by_name_for_checkpoints() -> None:
    tensor = _random(torch.complex128, 4)
    with pytest.raises(KeyError):  # safetensors itself has no code for it: nothing to store it as
        save_file({"z": tensor}, "/dev/null")
    spec = TensorSpec.of("model.z", tensor)
    assert spec.dtype == "complex128" and spec.nbytes == 64  # the sync path describes it
    for refuse in (lambda: spec.code, spec.checkpoint, lambda: specs_of({"model.z": tensor})):
        with pytest.raises(UnsupportedDtype, match=r"'model\.z'.*complex128.*cannot checkpoint"):
            refuse()
    with pytest.raises(UnsupportedDtype, match="complex128"):
        checkpoint_code(torch.complex128)
    assert torch.complex128 not in DTYPE_CODES


def test_a_dtype_outside_the_table_is_refused_by_both_paths_by_name() -> None:
    odd = torch.zeros(3, dtype=torch.float8_e4m3fnuz)
    with pytest.raises(UnsupportedDtype, match=r"tensor 'w' has dtype 'float8_e4m3fnuz'.*neither"):
        TensorSpec.of("w", odd)
    with pytest.raises(UnsupportedDtype, match=r"tensor 'w'"):
        specs_of({"w": odd})
    with pytest.raises(UnsupportedDtype, match=r"tensor 'w'"):
        TensorFusion().fuse({"w": odd})
    with pytest.raises(ValueError, match="float8_e4m3fnuz"):  # UnsupportedDtype is a ValueError: receivers map it
        parse_dtype("float8_e4m3fnuz")
    with pytest.raises(UnsupportedDtype, match="'F8_E4M3FNUZ'"):
        info_coded("F8_E4M3FNUZ")


@pytest.mark.parametrize("name", BRIEFED)
def test_every_briefed_dtype_fuses_and_rebuilds_from_the_wire_bit_exact(name: str) -> None:
    dtype = parse_dtype(name)
    tensors = {"lead": _random(torch.uint8, 3), "x": _random(dtype, 12).view(3, 4), "scalar": _random(dtype, 1)[0]}
    buffer, layout = TensorFusion().fuse(tensors)
    wire = FusionLayout.from_wire(layout.names, [s.dtype for s in layout.specs], [list(s.shape) for s in layout.specs])
    assert wire == layout and [s.dtype for s in wire.specs] == ["uint8", name, name]
    received = torch.empty(wire.total_bytes, dtype=torch.uint8)
    received[: buffer.numel()].copy_(buffer)
    back = TensorFusion().unfuse(received, wire)
    for key, tensor in tensors.items():
        assert back[key].dtype == tensor.dtype and back[key].shape == tensor.shape
        assert _bits(back[key]) == _bits(tensor), key
    assert tensor_bytes(name, [3, 4]) == 12 * dtype.itemsize  # a receiver accepts the announcement


def test_the_wire_speaks_dcs_names_only() -> None:
    with pytest.raises(UnsupportedDtype, match=r"tensor 'a'.*'F32'"):
        FusionLayout.from_wire(["a"], ["F32"], [[2]])


def test_a_spec_reads_either_spelling_and_checks_a_given_size() -> None:
    by_name, by_code = TensorSpec("w", "float8_e5m2", (2, 3)), TensorSpec("w", "F8_E5M2", (2, 3))
    assert by_name == by_code and hash(by_name) == hash(by_code)
    assert (
        by_code.dtype_name == "float8_e5m2" and by_name.code == "F8_E5M2" and by_name.torch_dtype is torch.float8_e5m2
    )
    assert by_name.checkpoint().dtype == "F8_E5M2" and by_code.checkpoint() is by_code
    assert TensorSpec("w", "U64", (4,), 32).nbytes == 32
    with pytest.raises(InvalidTensorSpec, match=r"'w': 31 bytes given, but uint64\[4\] is 32"):
        TensorSpec("w", "U64", (4,), 31)
    with pytest.raises(UnsupportedDtype, match=r"tensor 'w' has unsupported dtype 'float128'"):
        TensorSpec("w", "float128", (1,))


def test_should_fuse_from_specs_agrees_with_the_tensors() -> None:
    fusion = TensorFusion(threshold_bytes=1024)
    for tensors in ({"a": torch.zeros(1000)}, {"a": torch.zeros(200), "b": torch.zeros(200)}, {"a": torch.zeros(10)}):
        specs = [TensorSpec.of(n, t) for n, t in tensors.items()]
        assert fusion.should_fuse_specs(specs) == fusion.should_fuse(tensors)


def test_the_table_sizes_are_torchs_and_its_dtypes_are_torchs_own() -> None:
    for row in DTYPES:
        assert row.torch_dtype is getattr(torch, row.name)
        assert row.itemsize == row.torch_dtype.itemsize, row.name
    assert set(CODE_DTYPES) == {row.code for row in DTYPES if row.code is not None}
    assert all(DTYPE_CODES[CODE_DTYPES[code]] == code for code in CODE_DTYPES)
