"""The replicate task's copy never writes through a symlink planted in the replica tree (issue 20, finding 2):
an incremental step's files lie in the earlier step they refer to, and `<replica>/<run>/step-N` of that earlier
step may be a link to a folder outside the replica root."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dcs_tasks.checkpoint.format.layout import MANIFEST_NAME, Manifest, draft_of, manifest_bytes, plan_layout, specs_of
from dcs_tasks.checkpoint.replicating import copy_step
from dcs_tasks.checkpoint.state.structure import flatten_state
from dcs_tasks.errors import UntrustedPath
from dcs_tasks.interop.writer import write_file


def _primary(run_dir: Path) -> tuple[Path, Manifest]:
    """Step 1 holding one file, and step 2 referring to it (an incremental save that changed nothing)."""
    flat = flatten_state({"w": torch.arange(64, dtype=torch.float32)})
    layout = plan_layout(specs_of(flat.tensors), 1 << 20)
    one = run_dir / "step-000000001"
    one.mkdir(parents=True)
    entry = write_file(one, layout.files[0], flat.tensors, "t")
    first = Manifest(**draft_of("r", 1, layout, flat.structure, {}).model_dump(), files=[entry])
    (one / MANIFEST_NAME).write_bytes(manifest_bytes(first))
    two = run_dir / "step-000000002"
    two.mkdir()
    second = Manifest(**draft_of("r", 2, layout, flat.structure, {}).model_dump(), files=[entry.referring(1)])
    (two / MANIFEST_NAME).write_bytes(manifest_bytes(second))
    return two, second


def test_a_symlinked_earlier_replica_step_is_refused_and_nothing_lands_outside(tmp_path: Path) -> None:
    src_dir, manifest = _primary(tmp_path / "primary" / "r")
    outside = tmp_path / "outside"
    outside.mkdir()
    replica_run = tmp_path / "replica" / "r"
    replica_run.mkdir(parents=True)
    (replica_run / "step-000000001").symlink_to(outside)
    with pytest.raises(UntrustedPath, match=r"step-000000001.* is a symlink"):
        copy_step(src_dir, replica_run / "step-000000002", manifest, "t")
    assert list(outside.iterdir()) == []
    assert not (replica_run / "step-000000002" / MANIFEST_NAME).exists()


def test_the_same_copy_without_the_link_replicates_the_referred_file(tmp_path: Path) -> None:
    src_dir, manifest = _primary(tmp_path / "primary" / "r")
    replica_run = tmp_path / "replica" / "r"
    copy_step(src_dir, replica_run / "step-000000002", manifest, "t")
    held = manifest.files[0].stored_path(replica_run / "step-000000002")
    assert (
        held.parent.name == "step-000000001"
        and held.read_bytes() == (src_dir.parent / held.parent.name / held.name).read_bytes()
    )
