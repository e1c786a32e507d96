"""Crashes mid-save: kill -9 of worker children (redelivery, then the cap), Redis restart, disk full.

Writes are slowed with `persist_throttle_bytes_per_second` (a config knob the worker honours) so that a
fault can be injected while a file is being written.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from dcs_tasks import Checkpointer
from dcs_tasks.celery_app import node_queue
from dcs_tasks.checkpoint.restore.reader import load_manifest, read_latest, step_dirs, verify_step
from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import CheckpointFailed
from dcs_tasks.keys import Keys
from tests.checkpoint_support import assert_same_state, ckpt_config, start_worker, training_state, wait_until
from tests.helpers.procs import WorkerProcess
from tests.helpers.redis_server import RedisServer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MiB = 1 << 20


def _temps(step_dir: Path) -> list[Path]:
    return list(step_dir.glob(".*.tmp")) if step_dir.exists() else []


def _kill_children_mid_write(worker: WorkerProcess, step_dir: Path) -> None:
    wait_until(lambda: bool(_temps(step_dir)), 30, "a persist task to start writing")
    for pid in worker.child_pids():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_kill_9_mid_write_is_redelivered_and_commits_once(dcs_config: DCSConfig, tmp_path: Path) -> None:
    config = ckpt_config(dcs_config, tmp_path, file_shard_bytes=MiB, persist_throttle_bytes_per_second=MiB)
    worker = start_worker(config, tmp_path)
    state = training_state(width=512)  # ~2.1 MiB in 3 files
    try:
        with Checkpointer("kill9", config) as ckpt:
            pending = ckpt.save(state, step=1)
            _kill_children_mid_write(worker, pending.step_dir)
            info = pending.wait(timeout=90)
            assert [i.step for i in ckpt.list()] == [1]
            verify_step(info.path, load_manifest(info.path))
            assert _temps(info.path) == []
            on_disk = sorted(p.name for p in info.path.iterdir())
            assert on_disk == sorted([*(f.name for f in load_manifest(info.path).files), "manifest.json"])
            assert_same_state(state, ckpt.restore().state)
    finally:
        worker.kill()


def test_redelivery_cap_fails_the_save_instead_of_looping(dcs_config: DCSConfig, tmp_path: Path) -> None:
    config = ckpt_config(dcs_config, tmp_path, persist_throttle_bytes_per_second=MiB / 4, max_redeliveries=2)
    worker = start_worker(config, tmp_path)
    try:
        with Checkpointer("cap", config) as ckpt:
            pending = ckpt.save(training_state(width=256), step=1)  # one ~0.6 MiB file: ~2.5 s per attempt
            for _ in range(2):
                _kill_children_mid_write(worker, pending.step_dir)
                for tmp in _temps(pending.step_dir):  # the dead attempt's leftover; the next attempt recreates it
                    tmp.unlink()
            with pytest.raises(CheckpointFailed, match="delivered 3 times"):
                pending.wait(timeout=60)
            assert ckpt.list() == []
            wait_until(lambda: not pending.step_dir.exists(), 30, "the partial step directory to be removed")
    finally:
        worker.kill()


@pytest.mark.own_redis
def test_redis_restart_mid_save_then_new_saves_complete(
    dcs_config: DCSConfig, redis_server: RedisServer, tmp_path: Path
) -> None:
    config = ckpt_config(dcs_config, tmp_path, persist_throttle_bytes_per_second=MiB)
    worker = start_worker(config, tmp_path)
    state = training_state(width=400)
    try:
        with Checkpointer("redis", config) as ckpt:
            pending = ckpt.save(state, step=1)
            wait_until(lambda: bool(_temps(pending.step_dir)), 30, "the write to start")
            redis_server.restart(down_seconds=1.0)
            pending.wait(timeout=60)
            wait_until(lambda: worker.child_pids() != [] and _presence(ckpt), 30, "worker presence after restart")
            ckpt.save(state, step=2).wait(timeout=60)
            assert [i.step for i in ckpt.list()] == [1, 2]
            assert_same_state(state, ckpt.restore().state)
    finally:
        worker.kill()


@pytest.mark.own_redis
def test_a_worker_whose_stop_after_a_crash_waits_on_a_long_task_restarts_within_the_bound(
    dcs_config: DCSConfig, redis_server: RedisServer, tmp_path: Path
) -> None:
    """A Redis restart while a late-ack persist is unacknowledged makes Celery stop the worker ("Unrecoverable
    error" in kombu's restore_unacked). That stop is a warm shutdown, which waits for running tasks: here a
    persist with ~10 s left (in CI a Sentinel failover wedged it for over 45 s). `dcs worker` re-execs itself
    after worker_stuck_stop_seconds (3 s here) instead, killing the pool child; the new worker takes the task
    back, and the save commits."""
    bound = 3.0
    config = ckpt_config(
        dcs_config, tmp_path, persist_throttle_bytes_per_second=128 * 1024, worker_stuck_stop_seconds=bound
    )
    worker = start_worker(config, tmp_path)
    try:
        with Checkpointer("stuck", config) as ckpt:
            # ~1.36 MiB at 128 KiB/s: ~11 s of writing, most of it left when the bound runs out (Celery gives up
            # ~1 s after the restart): the stop waits on it. The new worker writes it all again
            pending = ckpt.save(training_state(width=340), step=1)
            wait_until(lambda: bool(_temps(pending.step_dir)), 30, "the write to start")
            children = set(worker.child_pids())
            redis_server.restart(down_seconds=1.0)
            crashed = time.monotonic()
            wait_until(lambda: "Unrecoverable error" in worker.log_tail(100_000), 15, "Celery to give up")
            wait_until(lambda: "still running after 3s" in worker.log_tail(100_000), bound + 10, "the bound")
            wait_until(
                lambda: (now := set(worker.child_pids())) != set() and now.isdisjoint(children) and _presence(ckpt),
                30,
                "the restarted worker",
            )
            assert time.monotonic() - crashed < bound + 15
            assert not any(Path(f"/proc/{pid}").exists() for pid in children)  # the old writer is gone
            assert "restored 1 task(s) of dcs.node." in worker.log_tail(100_000)  # the new worker took it back
            assert pending.wait(timeout=90).step == 1
            assert_same_state(training_state(width=340), ckpt.restore().state)
    finally:
        worker.kill()


@pytest.mark.own_redis
def test_a_shutdown_asked_for_during_a_stuck_stop_ends_the_worker_instead_of_restarting_it(
    dcs_config: DCSConfig, redis_server: RedisServer, tmp_path: Path
) -> None:
    """The same wedged stop, and an operator (or systemd, or Kubernetes) sends SIGTERM meanwhile: when the bound
    runs out the worker kills its pool and exits, rather than re-executing against the operator's wish."""
    bound = 3.0
    config = ckpt_config(
        dcs_config, tmp_path, persist_throttle_bytes_per_second=128 * 1024, worker_stuck_stop_seconds=bound
    )
    worker = start_worker(config, tmp_path)
    ckpt = Checkpointer("asked", config)
    try:
        pending = ckpt.save(training_state(width=400), step=1)
        wait_until(lambda: bool(_temps(pending.step_dir)), 30, "the write to start")
        children = set(worker.child_pids())
        redis_server.restart(down_seconds=1.0)
        wait_until(lambda: "Unrecoverable error" in worker.log_tail(100_000), 15, "Celery to give up")
        assert worker.proc is not None
        worker.proc.send_signal(signal.SIGTERM)
        assert worker.proc.wait(bound + 15) != 0  # ended by the bound, not by the task finishing
        log = worker.log_tail(100_000)
        assert "exiting" in log and "restarting now" not in log
        wait_until(lambda: not any(_alive(pid) for pid in children), 10, "the pool processes to be gone")
    finally:
        ckpt.close(timeout=0)  # the save is left to a worker started later (its task stays queued)
        worker.kill()


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting to be reaped does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _presence(ckpt: Checkpointer) -> bool:
    """Whether a live worker announces itself on this host's node queue (what `save()` checks first)."""
    client = redis.Redis.from_url(ckpt.config.redis.url)
    try:
        return bool(client.exists(Keys(ckpt.config.redis.namespace).worker_presence(node_queue(ckpt.config.host_name))))
    except redis.RedisError:
        return False
    finally:
        client.close()


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount_point)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount an 8 MiB tmpfs (needs root): {done.stderr.decode().strip()}")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_disk_full_fails_with_reason_and_keeps_previous_latest(
    dcs_config: DCSConfig, tmp_path: Path, small_disk: Path
) -> None:
    config = ckpt_config(dcs_config, tmp_path, checkpoint_dir=small_disk, file_shard_bytes=MiB)
    worker = start_worker(config, tmp_path)
    small, big = training_state(width=256), training_state(width=1200)  # ~0.6 MiB and ~11 MiB
    try:
        with Checkpointer("full", config) as ckpt:
            first = ckpt.save(small, step=1).wait(60)
            pending = ckpt.save(big, step=2)
            with pytest.raises(CheckpointFailed, match="No space left on device"):
                pending.wait(timeout=60)
            wait_until(lambda: pending.poll() is not None and pending.released, 30, "the staging buffer release")
            wait_until(lambda: not pending.step_dir.exists(), 30, "the failed step's files to be removed")
            assert read_latest(first.path.parent) == 1
            assert [s for s, _ in step_dirs(first.path.parent)] == [1]
            assert list(first.path.parent.rglob("*.tmp")) == []
            assert_same_state(small, ckpt.restore().state)
            ckpt.save(small, step=3).wait(60)  # the released buffer is reused
    finally:
        worker.kill()
