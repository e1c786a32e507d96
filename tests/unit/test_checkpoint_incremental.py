"""Incremental saves without a worker: hostile `source_step` references are refused by validate, a reference
resolves to the holding step's file and is checked there, the layout keeps changing tensors apart, and
retention keeps (and later drops) files that kept steps refer to, also when run again after a crash."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from dcs_tasks.checkpoint.format import validate
from dcs_tasks.checkpoint.format.layout import FileEntry, Manifest, TensorEntry, manifest_bytes, plan_layout, specs_of
from dcs_tasks.checkpoint.store.ledger.incremental import RETIRED_NAME
from dcs_tasks.checkpoint.store.ledger.retention import apply_retention
from dcs_tasks.checkpoint.store.payloads import RetentionPolicy
from dcs_tasks.checkpoint.store.reads import stepcheck
from dcs_tasks.errors import CorruptCheckpoint

FILE = "model-00001-of-00001.safetensors"


def _manifest(step: int = 5, source: Any = None) -> Manifest:
    entry: dict[str, Any] = {"name": FILE, "size": 144, "checksum": "0" * 32}
    if source is not None:
        entry["source_step"] = source
    return Manifest.model_validate(
        {
            "run": "r",
            "step": step,
            "created_at": 0.0,
            "files": [entry],
            "tensors": {"w": TensorEntry(file=FILE, dtype="F32", shape=[4, 4], offsets=(80, 144)).model_dump()},
            "structure": {"k": "tensor", "name": "w"},
        }
    )


@pytest.mark.parametrize("source", [5, 6, -1, 2**70, 10**30])
def test_a_reference_must_name_an_earlier_step(source: int) -> None:
    manifest = _manifest(source=source)
    with pytest.raises(CorruptCheckpoint, match=r"refers to step .*not an earlier step than 5"):
        validate.check_manifest(manifest, Path("m.json"))


@pytest.mark.parametrize("source", ["../x", "2/../3", [1], {"a": 1}, 1.5])
def test_a_reference_that_is_not_an_integer_is_unreadable(tmp_path: Path, source: Any) -> None:
    step_dir = tmp_path / "r" / "step-000000005"
    step_dir.mkdir(parents=True)
    raw = json.loads(manifest_bytes(_manifest()))
    raw["files"][0]["source_step"] = source
    (step_dir / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(CorruptCheckpoint, match="unreadable"):
        stepcheck.read_manifest(step_dir)


def test_a_reference_resolves_in_the_holding_step_and_is_checked_there(tmp_path: Path) -> None:
    run = tmp_path / "r"
    step_dir = run / "step-000000005"
    step_dir.mkdir(parents=True)
    manifest = _manifest(source=3)
    validate.check_manifest(manifest, Path("m.json"))
    assert manifest.files[0].stored_path(step_dir) == run / "step-000000003" / FILE
    with pytest.raises(CorruptCheckpoint, match=r"refers to step 3, whose directory .*step-000000003 does not exist"):
        stepcheck.check_files(step_dir, manifest)
    (run / "elsewhere").mkdir()
    (run / "step-000000003").symlink_to(run / "elsewhere")
    with pytest.raises(CorruptCheckpoint, match="is not a directory"):
        stepcheck.check_files(step_dir, manifest)
    (run / "step-000000003").unlink()
    (run / "step-000000003").mkdir()
    with pytest.raises(CorruptCheckpoint, match=r"step-000000003/model-00001-of-00001.safetensors is missing"):
        stepcheck.check_files(step_dir, manifest)
    assert FileEntry(name=FILE, size=1, checksum="0" * 32).referring(3).source_step == 3
    assert FileEntry(name=FILE, size=1, checksum="0" * 32, source_step=1).referring(3).source_step == 1  # no chain


def test_old_manifests_stay_valid_and_new_ones_without_references_do_not_name_the_field() -> None:
    assert "source_step" not in manifest_bytes(_manifest()).decode()
    assert '"source_step": 2' in manifest_bytes(_manifest(source=2)).decode()


def test_tensors_seen_changing_get_files_of_their_own() -> None:
    tensors = {f"layer{i}.{kind}": torch.zeros(64, 64) for i in range(4) for kind in ("frozen", "lora")}
    moving = frozenset(n for n in tensors if n.endswith("lora"))
    mixed = plan_layout(specs_of(tensors), 1 << 20)
    apart = plan_layout(specs_of(tensors), 1 << 20, moving)
    assert len(mixed.files) == 1
    kinds = [{slot.spec.name.split(".")[1] for slot in f.slots} for f in apart.files]
    assert kinds == [{"frozen"}, {"lora"}]
    assert plan_layout(specs_of(tensors), 1 << 20, moving) == apart  # stable for the same state and hint


def _step(run: Path, step: int, source: int | None) -> Path:
    step_dir = run / f"step-{step:09d}"
    step_dir.mkdir(parents=True)
    if source is None:
        (step_dir / FILE).write_bytes(bytes(144))
    (step_dir / "manifest.json").write_bytes(manifest_bytes(_manifest(step, source)))
    return step_dir


def test_retention_keeps_referenced_files_and_drops_them_when_no_kept_step_needs_them(tmp_path: Path) -> None:
    run = tmp_path / "r"
    one, two, three = _step(run, 1, None), _step(run, 2, 1), _step(run, 3, 1)
    keep_one = RetentionPolicy(keep_last=1)
    assert apply_retention(run, keep_one, set()) == [1, 2]
    assert not two.exists()
    assert sorted(p.name for p in one.iterdir()) == [RETIRED_NAME, FILE]  # retired: no manifest, bytes kept
    assert _manifest(3, 1).files[0].stored_path(three).is_file()
    # a crash of a later retention right after writing step 3's marker leaves it committed and marked
    (three / RETIRED_NAME).write_bytes(b"")
    (one / "stray.tmp").write_bytes(b"x")  # and a crash mid-retire left a file no one refers to
    four = _step(run, 4, None)
    assert apply_retention(run, keep_one, set(), lambda: {(1, FILE)}) == [3]  # a step in flight refers to 1
    assert not three.exists()  # holds nothing anyone needs: removed whole, marker and all
    assert sorted(p.name for p in one.iterdir()) == [RETIRED_NAME, FILE]  # the stray file went, the bytes stay
    assert apply_retention(run, keep_one, set()) == []
    assert not one.exists()  # nothing refers to step 1 any more: its retired directory is gone
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("step-")) == [four.name]
