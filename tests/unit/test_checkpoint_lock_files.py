"""A worker never creates or opens a file through a symlink planted at a run's lock files (issue 20, finding 6):
`.latest.lock` (moving `latest`) and `.refs.lock` (incremental references, retention) are opened with
O_NOFOLLOW relative to the run directory's own fd, and only as regular files."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from dcs_tasks.checkpoint.format.layout import LATEST_NAME
from dcs_tasks.checkpoint.restore.reader import read_latest
from dcs_tasks.checkpoint.store.ledger.incremental import REFS_LOCK_NAME, refs_lock
from dcs_tasks.checkpoint.store.ledger.latest import LATEST_LOCK_NAME, move_latest
from dcs_tasks.errors import UntrustedPath


def _latest(run_dir: Path) -> None:
    move_latest(run_dir, 3, "t")


def _refs(run_dir: Path) -> None:
    with refs_lock(run_dir, shared=True):
        pass


CASES: list[tuple[str, Callable[[Path], None]]] = [(LATEST_LOCK_NAME, _latest), (REFS_LOCK_NAME, _refs)]


@pytest.mark.parametrize(("name", "take"), CASES)
def test_a_symlinked_lock_file_is_refused_and_its_target_never_created(
    tmp_path: Path, name: str, take: Callable[[Path], None]
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    target = tmp_path / "outside" / "planted"
    target.parent.mkdir()
    (run_dir / name).symlink_to(target)
    with pytest.raises(UntrustedPath, match=rf"lock file .*{name}.* is a symlink"):
        take(run_dir)
    assert not os.path.lexists(target)
    assert not (run_dir / LATEST_NAME).exists()


@pytest.mark.timeout(20)  # the old code blocked here for good (open for append of a FIFO)
@pytest.mark.parametrize(("name", "take"), CASES)
def test_a_fifo_lock_file_is_refused_without_blocking(tmp_path: Path, name: str, take: Callable[[Path], None]) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.mkfifo(run_dir / name)
    with pytest.raises(UntrustedPath, match="not a regular file"):
        take(run_dir)


@pytest.mark.parametrize(("name", "take"), CASES)
def test_a_symlinked_run_directory_is_refused(tmp_path: Path, name: str, take: Callable[[Path], None]) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "run").symlink_to(elsewhere)
    with pytest.raises(UntrustedPath, match="is a symlink or not a directory"):
        take(tmp_path / "run")
    assert list(elsewhere.iterdir()) == []


def test_plain_lock_files_still_work(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    move_latest(run_dir, 3, "t")
    move_latest(run_dir, 2, "t")  # never backwards
    assert read_latest(run_dir) == 3
    with refs_lock(run_dir, shared=False):
        pass
    assert (run_dir / LATEST_LOCK_NAME).is_file() and (run_dir / REFS_LOCK_NAME).is_file()
