"""docs/reliability.md faults 2 and 3: the whole worker is killed (-9) or warm-stopped (SIGTERM) mid-write and a
new worker is started; the save completes once, with verified files."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from dcs_tasks import Checkpointer
from dcs_tasks.checkpoint.restore.reader import load_manifest, verify_step
from dcs_tasks.config import DCSConfig
from tests.checkpoint_support import assert_same_state, ckpt_config, start_worker, training_state, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MiB = 1 << 20


def _writing(step_dir: Path) -> bool:
    return step_dir.exists() and any(step_dir.glob(".*.tmp"))


def _assert_committed_once(ckpt: Checkpointer, step_dir: Path) -> None:
    assert [i.step for i in ckpt.list()] == [1]
    manifest = load_manifest(step_dir)
    verify_step(step_dir, manifest)
    assert sorted(p.name for p in step_dir.iterdir()) == sorted([*(f.name for f in manifest.files), "manifest.json"])


def test_sigterm_mid_write_then_new_worker_completes_the_save(dcs_config: DCSConfig, tmp_path: Path) -> None:
    config = ckpt_config(dcs_config, tmp_path, persist_throttle_bytes_per_second=MiB)
    state = training_state(width=400)  # ~1.3 MiB: ~1.3 s per write
    worker = start_worker(config, tmp_path, name="first")
    with Checkpointer("warm", config) as ckpt:
        pending = ckpt.save(state, step=1)
        wait_until(lambda: _writing(pending.step_dir), 30, "the write to start")
        worker.terminate()  # warm shutdown: the running persist finishes, the commit stays queued
        replacement = start_worker(config, tmp_path, name="second")
        try:
            pending.wait(timeout=60)
            _assert_committed_once(ckpt, pending.step_dir)
            assert_same_state(state, ckpt.restore().state)
        finally:
            replacement.discard()


def test_kill_9_of_the_whole_worker_then_new_worker_completes_the_save(dcs_config: DCSConfig, tmp_path: Path) -> None:
    # default visibility timeout (600 s): the replacement takes back the dead worker's unacked tasks at start-up
    config = ckpt_config(dcs_config, tmp_path, persist_throttle_bytes_per_second=MiB)
    assert config.task.visibility_timeout_seconds >= 600
    state = training_state(width=400)
    worker = start_worker(config, tmp_path, name="first")
    with Checkpointer("dead", config) as ckpt:
        pending = ckpt.save(state, step=1)
        wait_until(lambda: _writing(pending.step_dir), 30, "the write to start")
        worker.kill()
        killed_at = time.monotonic()
        replacement = start_worker(config, tmp_path, name="second")
        try:
            pending.wait(timeout=60)
            assert time.monotonic() - killed_at < 60  # not the visibility timeout
            _assert_committed_once(ckpt, pending.step_dir)
            assert_same_state(state, ckpt.restore().state)
            assert "left unacknowledged by a dead worker" in replacement.log_tail(100_000)
        finally:
            replacement.discard()


def test_close_before_the_save_is_durable_keeps_its_staging_and_the_save_commits(
    dcs_config: DCSConfig, tmp_path: Path
) -> None:
    """A trainer that exits (close() with a short timeout) while its last save is still being written must
    not delete the staged bytes under the worker: the save still commits."""
    config = ckpt_config(dcs_config, tmp_path, persist_throttle_bytes_per_second=MiB)
    state = training_state(width=400)  # ~1.3 MiB: ~1.3 s per write
    worker = start_worker(config, tmp_path)
    try:
        ckpt = Checkpointer("last", config)
        pending = ckpt.save(state, step=7)
        staged = list(Path(config.host.staging_dir).glob("dcs-*last*"))
        assert staged, "the save was staged in /dev/shm"
        assert ckpt.close(timeout=0.2) == (7,)
        assert all(p.exists() for p in staged), "close() deleted staging a worker still needs"
        with Checkpointer("last", config) as fresh:
            wait_until(lambda: [i.step for i in fresh.list()] == [7], 60, "the save to commit")
            assert_same_state(state, fresh.restore().state)
        assert pending.step_dir.is_dir()
    finally:
        worker.discard()
