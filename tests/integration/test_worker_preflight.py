"""`dcs worker` checks at start what the host can honour, and refuses to start (exit 1, one message naming the
setting and the fix) instead of failing saves later:

- a memory tier bigger than its directory's file system (as met: a 16 MiB tmpfs under a 64 MiB budget gave
  2-3 s stalls, 12 of 14 saves failed with "No space left on device" and the restore came back at step 1);
- a checkpoint root that cannot be written.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dcs_tasks.config import DCSConfig
from tests.checkpoint_support import ckpt_config, mounted_tmpfs, start_worker
from tests.helpers.procs import WorkerProcess

pytestmark = pytest.mark.integration

MiB = 1024 * 1024


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs (private), unmounted afterwards."""
    with mounted_tmpfs(tmp_path) as mount_point:
        yield mount_point


def refusal(config: DCSConfig, tmp_path: Path) -> tuple[str, float]:
    """Start `dcs worker` with `config`; assert it refuses (exits 1 without ever serving); its log and how long
    the refusal took."""
    worker = WorkerProcess(config, tmp_path / "worker.log")
    began = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="worker exited with 1") as caught:
            worker.start(timeout=60)
    finally:
        worker.discard()
    return str(caught.value), time.monotonic() - began


def test_a_memory_tier_budget_larger_than_its_tmpfs_stops_the_worker_at_start(
    dcs_config: DCSConfig, tmp_path: Path, small_tmpfs: Path
) -> None:
    config = ckpt_config(dcs_config, tmp_path, memory_tier_bytes=64 * MiB, memory_dir=small_tmpfs)
    log, seconds = refusal(config, tmp_path)
    assert f"DCS_MEMORY_TIER_BYTES={64 * MiB} exceeds" in log and str(small_tmpfs) in log, log
    assert "No space left on device" in log and "set DCS_MEMORY_TIER_BYTES to at most" in log, log
    print(f"worker refused in {seconds:.1f} s")


def test_a_memory_tier_budget_that_fits_starts(
    dcs_config: DCSConfig, tmp_path: Path, small_tmpfs: Path, worker_cleanup: list[WorkerProcess]
) -> None:
    config = ckpt_config(dcs_config, tmp_path, memory_tier_bytes=8 * MiB, memory_dir=small_tmpfs)
    worker_cleanup.append(start_worker(config, tmp_path))


def test_a_checkpoint_root_that_cannot_be_written_stops_the_worker_at_start(
    dcs_config: DCSConfig, tmp_path: Path
) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    config = ckpt_config(dcs_config, tmp_path, checkpoint_dir=tmp_path / "a-file" / "ckpt")
    log, _ = refusal(config, tmp_path)
    assert f"checkpoint_dir {tmp_path / 'a-file' / 'ckpt'} cannot be written" in log, log
    assert "is not a directory" in log and "DCS_CHECKPOINT_DIR" in log, log


@pytest.fixture
def worker_cleanup() -> Iterator[list[WorkerProcess]]:
    started: list[WorkerProcess] = []
    yield started
    for worker in started:
        worker.discard()
