"""`move_latest(first=...)`: the commit's manifest write runs under the `latest` lock while `latest` is read
beside it; `latest` names the new step only once that write is stored, and not at all when it fails."""

from __future__ import annotations

from pathlib import Path

import pytest

from dcs_tasks.checkpoint.restore.reader import read_latest
from dcs_tasks.checkpoint.store.ledger.latest import move_latest


def test_latest_moves_only_after_the_first_write_is_stored(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    move_latest(run_dir, 3, "t")
    seen: list[int | None] = []

    def write_manifest() -> None:
        seen.append(read_latest(run_dir))
        (run_dir / "manifest-4").write_bytes(b"{}")

    move_latest(run_dir, 4, "t", first=write_manifest)
    assert seen == [3]  # `latest` still named the old step while the write ran
    assert (run_dir / "manifest-4").is_file() and read_latest(run_dir) == 4


def test_a_failed_first_write_leaves_latest_as_it_was(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    move_latest(run_dir, 3, "t")

    def fail() -> None:
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        move_latest(run_dir, 4, "t", first=fail)
    assert read_latest(run_dir) == 3


def test_the_first_write_runs_even_when_latest_is_newer(tmp_path: Path) -> None:
    """A commit of an older step (steps may commit out of order) still stores its manifest; `latest` stays."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    move_latest(run_dir, 5, "t")
    wrote: list[bool] = []
    move_latest(run_dir, 4, "t", first=lambda: wrote.append(True))
    assert wrote == [True] and read_latest(run_dir) == 5
