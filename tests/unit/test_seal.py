"""seal: a stamp holds only for the unchanged, read-only file it was taken of; a bad `seal.json` reads as none."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dcs_tasks.checkpoint.store.tiers.seal import MAX_SEAL_BYTES, SEAL_NAME, Stamp, read_seals, seal_step


def _sealed(tmp_path: Path) -> tuple[Path, Stamp]:
    path = tmp_path / "model-00001-of-00001.safetensors"
    path.write_bytes(b"x" * 10_000)
    return path, seal_step(tmp_path, [path.name])[path.name]


def test_a_stamp_holds_for_the_file_it_sealed_and_read_seals_returns_it(tmp_path: Path) -> None:
    path, stamp = _sealed(tmp_path)
    assert path.stat().st_mode & 0o777 == 0o444
    assert stamp.holds(path.stat()) and read_seals(tmp_path) == {path.name: stamp}
    assert read_seals(tmp_path / "missing") == {}


@pytest.mark.parametrize("change", ["write", "truncate", "chmod-back", "chmod-writable", "replace"])
def test_any_change_to_a_sealed_file_breaks_its_stamp(tmp_path: Path, change: str) -> None:
    path, stamp = _sealed(tmp_path)
    if change == "write":
        os.chmod(path, 0o644)
        with open(path, "r+b") as f:
            f.write(b"y")
        os.chmod(path, 0o444)
    elif change == "truncate":
        os.chmod(path, 0o644)
        os.truncate(path, 10_000)  # same size: only the times move
        os.chmod(path, 0o444)
    elif change == "chmod-back":
        os.chmod(path, 0o644)
        os.chmod(path, 0o444)
    elif change == "chmod-writable":
        os.chmod(path, 0o644)
    else:
        other = tmp_path / "other"
        other.write_bytes(path.read_bytes())
        os.chmod(other, 0o444)
        os.replace(other, path)
    os.utime(path, ns=(stamp.mtime_ns, stamp.mtime_ns))  # mtime can be set back; ctime cannot
    assert not stamp.holds(path.stat())


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"\xff\xfe",
        b"[1, 2]",
        json.dumps({"format": 2, "files": {}}).encode(),
        json.dumps({"format": 1, "files": []}).encode(),
        json.dumps({"format": 1, "files": {"a": [1, 2, 3]}}).encode(),
        json.dumps({"format": 1, "files": {"a": [1, 2, 3, -4]}}).encode(),
        json.dumps({"format": 1, "files": {"a": [1, 2, 3, 1 << 64]}}).encode(),
        json.dumps({"format": 1, "files": {"a": [1, 2, 3, 4.0]}}).encode(),
        json.dumps({"format": 1, "files": {"a": [True, 2, 3, 4]}}).encode(),
        b"[" * 50_000 + b"]" * 50_000,
        b" " * (MAX_SEAL_BYTES + 1),
    ],
    ids=lambda b: repr(b[:24]),
)
def test_a_bad_seal_record_reads_as_none(tmp_path: Path, body: bytes) -> None:
    (tmp_path / SEAL_NAME).write_bytes(body)
    assert read_seals(tmp_path) == {}


def test_a_seal_record_that_is_a_symlink_or_a_directory_is_not_followed(tmp_path: Path) -> None:
    _sealed(tmp_path)
    real = tmp_path / "elsewhere.json"
    os.replace(tmp_path / SEAL_NAME, real)
    (tmp_path / SEAL_NAME).symlink_to(real)
    assert read_seals(tmp_path) == {}
    (tmp_path / SEAL_NAME).unlink()
    (tmp_path / SEAL_NAME).mkdir()
    assert read_seals(tmp_path) == {}
