"""What a trainer and its worker must share (`dcs_tasks.checkpoint.agreement.disagreements`): each difference is
one line naming the setting, both values and the fix; equal settings give none."""

from __future__ import annotations

from pathlib import Path

from dcs_tasks.checkpoint.agreement import WorkerSettings, disagreements, effective
from dcs_tasks.config import DCSConfig

BASE = WorkerSettings(checkpoint_dir="/data/ckpt", staging_dir="/dev/shm/dcs-0/staging")


def test_equal_settings_agree_and_paths_compare_resolved(tmp_path: Path) -> None:
    assert disagreements(BASE, BASE) == []
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    a = effective(DCSConfig(checkpoint_dir=tmp_path / "link", staging_dir=tmp_path))
    b = effective(DCSConfig(checkpoint_dir=f"file://{tmp_path / 'real'}", staging_dir=tmp_path))
    assert disagreements(a, b) == []


def test_the_storage_cadence_is_the_trainers_alone() -> None:
    mine = BASE.model_copy(update={"storage_every_steps": 4, "storage_every_seconds": 60.0})
    assert disagreements(mine, BASE) == []


def test_each_shared_setting_that_differs_is_one_line_with_both_values() -> None:
    theirs = BASE.model_copy(update={"memory_tier_bytes": 100, "memory_dir": "/dev/shm/w"})
    mine = BASE.model_copy(update={"staging_dir": "/tmp/stage", "memory_tier_bytes": 200, "memory_dir": "/dev/shm/t"})
    lines = disagreements(mine, theirs)
    assert [line.split(":")[0] for line in lines] == ["staging_dir", "memory_tier_bytes", "memory_dir"], lines
    assert "DCS_MEMORY_TIER_BYTES=100 in the trainer's environment" in lines[1], lines[1]
    assert "DCS_MEMORY_TIER_BYTES=200" in lines[1] and "/dev/shm/t" in lines[2] and "/dev/shm/w" in lines[2]


def test_an_object_root_compares_its_url_and_endpoint() -> None:
    s3 = WorkerSettings(checkpoint_dir="s3://b/p", staging_dir="/s", s3_endpoint_url="http://127.0.0.1:9000")
    other = s3.model_copy(update={"s3_endpoint_url": "http://10.0.0.5:9000"})
    (line,) = disagreements(s3, other)
    assert line.startswith("s3_endpoint_url:") and "10.0.0.5" in line
    (line,) = disagreements(s3, s3.model_copy(update={"checkpoint_dir": "s3://b/q"}))
    assert line.startswith("checkpoint_dir:") and "s3://b/q" in line
