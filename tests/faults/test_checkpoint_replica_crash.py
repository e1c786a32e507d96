"""kill -9 of the worker's children while a step is being copied to the replica root: the half-copied replica
step is never seen as a step (no manifest yet), and the redelivered replicate task completes it."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
from pathlib import Path

import pytest

from dcs_tasks import Checkpointer
from dcs_tasks.checkpoint.format.layout import step_dir_name
from dcs_tasks.checkpoint.restore.reader import load_manifest, read_latest, step_dirs, verify_step
from dcs_tasks.config import DCSConfig
from tests.checkpoint_support import assert_same_state, ckpt_config, start_worker, training_state, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MiB = 1 << 20


def test_kill_9_mid_replication_is_redelivered_and_no_half_copy_is_a_step(
    dcs_config: DCSConfig, tmp_path: Path
) -> None:
    replica = tmp_path / "replica"
    # the throttle knob slows every worker write, the replica's copies included: ~2 MiB in 3 files, ~2 s
    config = ckpt_config(
        dcs_config, tmp_path, replica_dir=replica, file_shard_bytes=MiB, persist_throttle_bytes_per_second=MiB
    )
    worker = start_worker(config, tmp_path)
    state = training_state(seed=9, width=512)
    target = replica / "crash" / step_dir_name(1)
    try:
        with Checkpointer("crash", config) as ckpt:
            ckpt.save(state, step=1).wait(timeout=120)
            wait_until(lambda: bool(list(target.glob(".*.tmp"))) if target.exists() else False, 60, "a replica copy")
            for pid in worker.child_pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            assert step_dirs(replica / "crash") == []  # the half copy has no manifest: not a step
            assert read_latest(replica / "crash") is None
            wait_until(lambda: bool(step_dirs(replica / "crash")), 120, "the redelivered replica to complete")
    finally:
        worker.kill()
    manifest = load_manifest(target)
    verify_step(target, manifest)
    assert sorted(p.name for p in target.iterdir()) == sorted([*(f.name for f in manifest.files), "manifest.json"])
    assert read_latest(replica / "crash") == 1
    shutil.rmtree(Path(config.checkpoint.dir) / "crash" / step_dir_name(1))
    with Checkpointer("crash", config) as ckpt:
        restored = ckpt.restore()
    assert restored.location == "replica"
    assert_same_state(state, restored.state)
