"""Manifests, structures and safetensors headers are untrusted input: each check refuses with CorruptCheckpoint
naming the reason (the decoder only builds what `flatten_state` writes; the header parser never trusts a
length or an offset), and a random header never raises anything else."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcs_tasks.checkpoint.format import validate
from dcs_tasks.checkpoint.format.layout import FileEntry, Manifest, TensorEntry
from dcs_tasks.checkpoint.state.structure import flatten_state, unflatten_state
from dcs_tasks.checkpoint.store.reads import stepcheck
from dcs_tasks.errors import CorruptCheckpoint

CHECKSUM = "0" * 32
FILE = "model-00001-of-00001.safetensors"


def _manifest(**changes: Any) -> Manifest:
    """A consistent one-tensor manifest (80 header bytes, then 4 x 4 float32)."""
    values: dict[str, Any] = {
        "run": "r",
        "step": 1,
        "created_at": 0.0,
        "files": [FileEntry(name=FILE, size=144, checksum=CHECKSUM)],
        "tensors": {"w": TensorEntry(file=FILE, dtype="F32", shape=[4, 4], offsets=(80, 144))},
        "structure": {"k": "tensor", "name": "w"},
    }
    values.update(changes)
    return Manifest(**values)


def _entry(**changes: Any) -> dict[str, TensorEntry]:
    values: dict[str, Any] = {"file": FILE, "dtype": "F32", "shape": [4, 4], "offsets": (80, 144)}
    values.update(changes)
    return {"w": TensorEntry(**values)}


def test_a_consistent_manifest_passes() -> None:
    validate.check_manifest(_manifest(), Path("m.json"))


@pytest.mark.parametrize("created_at", ["1e300", "NaN", "Infinity", "-1", "7258118400.5"])
def test_an_impossible_created_at_is_corrupt(tmp_path: Path, created_at: str) -> None:
    """Issue 20, finding 9: finite, 0 .. 2200-01-01 (every reader formats it as a date)."""
    raw = _manifest().model_dump_json().replace('"created_at":0.0', f'"created_at":{created_at}')
    assert created_at in raw
    (tmp_path / "manifest.json").write_text(raw)
    with pytest.raises(CorruptCheckpoint, match="created_at"):
        stepcheck.read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text(_manifest(created_at=7258118400.0).model_dump_json())
    assert stepcheck.read_manifest(tmp_path).created_at == 7258118400.0


@pytest.mark.parametrize(
    ("tensors", "reason"),
    [
        (_entry(dtype="Q9"), "not a safetensors dtype"),
        (_entry(shape=[4, 5]), "has 80 bytes, but spans 64"),
        (_entry(shape=[-4, -4]), "not a tensor shape"),
        (_entry(shape=[1] * 65), "not a tensor shape"),
        (_entry(file="model-00002-of-00002.safetensors"), "which the manifest does not list"),
        (_entry(offsets=(80, 2**70)), "outside its file"),
        (_entry(offsets=(-64, 0)), "outside its file"),
        (_entry(shape=[2**62, 2**62]), "spans 64"),
        (_entry(offsets=(82, 146)), "outside its file"),
        (_entry(shape=[4, 4], offsets=(78, 142)), "not aligned"),
    ],
)
def test_tensor_entries_are_checked_against_each_other_and_the_file_size(
    tensors: dict[str, TensorEntry], reason: str
) -> None:
    with pytest.raises(CorruptCheckpoint, match=reason):
        validate.check_manifest(_manifest(tensors=tensors), Path("m.json"))


@pytest.mark.parametrize(
    "name", ["../../etc/passwd", "/etc/passwd", "..", ".", "", "a/b.safetensors", ".hidden.safetensors", "x\0.s"]
)
def test_file_names_must_be_plain_basenames(name: str) -> None:
    files = [FileEntry(name=name, size=144, checksum=CHECKSUM)]
    with pytest.raises(CorruptCheckpoint, match="not a plain safetensors file name"):
        validate.check_manifest(_manifest(files=files, tensors={}, structure={"k": "v", "v": None}), Path("m"))


def test_overlapping_tensors_duplicate_files_and_bad_sharding_are_refused() -> None:
    two = {"a": _entry()["w"], "b": TensorEntry(file=FILE, dtype="F32", shape=[2], offsets=(136, 144))}
    with pytest.raises(CorruptCheckpoint, match="overlap"):
        validate.check_manifest(_manifest(tensors=two, structure={"k": "v", "v": 1}), Path("m"))
    twice = [FileEntry(name=FILE, size=144, checksum=CHECKSUM)] * 2
    with pytest.raises(CorruptCheckpoint, match="listed twice"):
        validate.check_manifest(_manifest(files=twice), Path("m"))
    with pytest.raises(CorruptCheckpoint, match="no dimension 2"):
        validate.check_manifest(_manifest(sharded_dims={"w": 2}), Path("m"))
    with pytest.raises(CorruptCheckpoint, match="is not a tensor of the manifest"):
        validate.check_manifest(_manifest(sharded_dims={"nope": 0}), Path("m"))
    with pytest.raises(CorruptCheckpoint, match="rank 3 is not a rank"):
        validate.check_manifest(_manifest(rank=3, world_size=2), Path("m"))


@pytest.mark.parametrize(
    ("node", "reason"),
    [
        ({"k": "dtype", "v": "save"}, "not a torch dtype"),
        ({"k": "dtype", "v": "load"}, "not a torch dtype"),
        ({"k": "dtype", "v": "nn"}, "not a torch dtype"),
        ({"k": "module", "v": "os"}, "unknown node kind"),
        ({"k": "tensor", "name": "nope"}, "does not hold"),
        ({"k": "v", "v": [1, 2]}, "plain value"),
        ({"k": "v", "v": 1.5}, "plain value"),
        ({"k": "float", "v": "0x1p99999"}, "not a valid float"),
        ({"k": "device", "v": "warp-drive:7"}, "not a valid device"),
        ({"k": "size", "v": [-1]}, "non-negative"),
        ({"k": "list", "items": [], "extra": 1}, "expected"),
        ({"k": "dict", "keys": [{"k": "v", "v": "a"}], "values": []}, "1 keys but 0 values"),
        ({"k": "dict", "keys": [{"k": "list", "items": []}], "values": [{"k": "v", "v": 1}]}, "not a plain value"),
        ({"k": "odict", "keys": [], "values": [], "meta": {"m": {"version": [1]}}}, "module metadata"),
        ([1, 2], "must be a JSON object"),
    ],
)
def test_structure_decoder_accepts_only_what_dcs_writes(node: Any, reason: str) -> None:
    with pytest.raises(CorruptCheckpoint, match=reason):
        unflatten_state(node, {"w": torch.zeros(1)})


def test_the_format_stage_checks_the_structure_form_and_restore_its_torch_names(tmp_path: Path) -> None:
    """`validate` (no torch) refuses every node of the wrong form; whether a dtype or device name is one torch
    knows is checked by `reader.load_manifest` (restore), still before any data file is read."""
    from dcs_tasks.checkpoint.restore.reader import load_manifest

    with pytest.raises(CorruptCheckpoint, match="unknown node kind"):
        validate.check_manifest(_manifest(structure={"k": "module", "v": "os"}), Path("m.json"))
    with pytest.raises(CorruptCheckpoint, match="nested deeper"):
        node: dict[str, Any] = {"k": "tensor", "name": "w"}
        for _ in range(300):
            node = {"k": "list", "items": [node]}
        validate.check_structure_form(node, ["w"])
    odd = {"k": "list", "items": [{"k": "tensor", "name": "w"}, {"k": "dtype", "v": "save"}]}
    step_dir = tmp_path / "step-000000001"
    step_dir.mkdir()
    (step_dir / "manifest.json").write_text(_manifest(structure=odd).model_dump_json())
    assert stepcheck.read_manifest(step_dir).structure == odd
    with pytest.raises(CorruptCheckpoint, match="not a torch dtype") as refused:
        load_manifest(step_dir)
    assert str(step_dir / "manifest.json") in str(refused.value)


def test_structure_nesting_is_bounded() -> None:
    node: dict[str, Any] = {"k": "v", "v": 1}
    for _ in range(1000):
        node = {"k": "list", "items": [node]}
    with pytest.raises(CorruptCheckpoint, match="nested deeper"):
        unflatten_state(node, {})


def test_everything_flatten_writes_still_decodes() -> None:
    state = {
        "d": torch.float8_e4m3fn,
        "dev": torch.device("cpu"),
        "size": torch.Size([2, 0]),
        "f": float("-inf"),
        3: (None, True, "s", [1]),
        None: 1,
    }
    flat = flatten_state(state)
    back = unflatten_state(json.loads(json.dumps(flat.structure)), flat.tensors)
    assert back == state


@pytest.mark.parametrize(
    ("prefix", "header", "reason"),
    [
        (struct.pack("<Q", 0xFFFFFFFFFFFFFFFF), b"{}", "header length 18446744073709551615 exceeds"),
        (None, b"[1, 2]", "not a JSON object"),
        (None, b"\xff\xfe", "not a JSON object"),
        (None, b'{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 128]}}', "no consistent"),
        (None, b'{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}', "no consistent"),
        (None, b'{"w": {"dtype": "X", "shape": [2], "data_offsets": [0, 8]}}', "no consistent"),
        (None, b'{"w": {"dtype": {"F32": 1}, "shape": [2], "data_offsets": [0, 8]}}', "no consistent"),
        (None, b'{"w": {"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]}}', "no consistent"),
        (None, b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8.0]}}', "no consistent"),
        (None, b'{"w": {"dtype": "F32", "shape": [true, 2], "data_offsets": [0, 8]}}', "no consistent"),
        (None, b'{"w": [1, 2]}', "no consistent"),
    ],
)
def test_safetensors_header_is_bounded_and_checked(
    tmp_path: Path, prefix: bytes | None, header: bytes, reason: str
) -> None:
    path = tmp_path / FILE
    path.write_bytes((prefix or struct.pack("<Q", len(header))) + header + b"\0" * 64)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(CorruptCheckpoint, match=reason):
            stepcheck.read_header(fd, path, os.fstat(fd).st_size)
    finally:
        os.close(fd)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(length=st.integers(0, 2**64 - 1), body=st.binary(max_size=200), size=st.integers(0, 300))
def test_random_headers_raise_only_corrupt_checkpoint(tmp_path: Path, length: int, body: bytes, size: int) -> None:
    path = tmp_path / FILE
    raw = struct.pack("<Q", length) + body
    path.write_bytes(raw[:size])
    fd = os.open(path, os.O_RDONLY)
    try:
        header, start = stepcheck.read_header(fd, path, os.fstat(fd).st_size)
        assert isinstance(header, dict) and start == 8 + length <= len(raw[:size])
    except CorruptCheckpoint as exc:
        assert str(path) in str(exc)
    finally:
        os.close(fd)


JSON_LEAF = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.text(max_size=4),
    st.floats(),
    st.lists(st.integers(-2, 64), max_size=3),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
)
HEADER_ENTRY = st.fixed_dictionaries(
    {
        "dtype": st.one_of(st.sampled_from(sorted(validate.ITEMSIZE)), JSON_LEAF),
        "shape": st.one_of(st.lists(st.integers(-2, 2**40), max_size=4), JSON_LEAF),
        "data_offsets": st.one_of(st.lists(st.integers(-(2**65), 2**65), max_size=3), JSON_LEAF),
    }
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    entries=st.dictionaries(st.text(max_size=3), st.one_of(HEADER_ENTRY, JSON_LEAF), max_size=4),
    data=st.integers(0, 200),
)
def test_random_json_headers_raise_only_corrupt_checkpoint(tmp_path: Path, entries: dict[str, Any], data: int) -> None:
    path = tmp_path / FILE
    header = json.dumps(entries).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * data)
    fd = os.open(path, os.O_RDONLY)
    try:
        parsed, _ = stepcheck.read_header(fd, path, os.fstat(fd).st_size)
    except CorruptCheckpoint:
        return
    finally:
        os.close(fd)
    for name, entry in parsed.items():  # accepted: every tensor's bytes lie inside the data section
        if name != "__metadata__":
            begin, end = entry["data_offsets"]
            assert 0 <= begin <= end <= data
            assert end - begin == validate.shape_bytes(entry["shape"], validate.ITEMSIZE[entry["dtype"]])


def test_latest_pointer_is_read_only_from_a_short_regular_file(tmp_path: Path) -> None:
    from dcs_tasks.checkpoint.restore.reader import read_latest

    run = tmp_path / "run"
    run.mkdir()
    (run / "latest").write_text("step-000000007\n")
    assert read_latest(run) == 7
    outside = tmp_path / "elsewhere"
    outside.write_text("step-000000002")
    (run / "latest").unlink()
    (run / "latest").symlink_to(outside)  # never followed
    assert read_latest(run) is None
    (run / "latest").unlink()
    with (run / "latest").open("wb") as f:  # a huge (sparse) file is not read into memory
        f.truncate(1 << 40)
    assert read_latest(run) is None
