"""Staging policies (block / skip, bounded memory, buffer reuse), retention after commit, and `dcs ckpt`."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import redis

from dcs_tasks import Checkpointer
from dcs_tasks.celery_app import make_celery, node_queue
from dcs_tasks.config import DCSConfig, StagingPolicy
from dcs_tasks.errors import CheckpointFailed, StagingError
from dcs_tasks.keys import Keys
from tests.checkpoint_support import Inline, ckpt_config, training_state, wait_until
from tests.helpers.preloaded import run_module
from tests.helpers.procs import child_env
from tests.helpers.redis_server import RedisServer

pytestmark = pytest.mark.integration

MiB = 1 << 20


def test_skip_policy_returns_a_skipped_handle_and_memory_stays_bounded(
    dcs_config: DCSConfig, tmp_path: Path, inline: Inline
) -> None:
    config = ckpt_config(
        dcs_config,
        tmp_path,
        staging_buffers=1,
        staging_policy=StagingPolicy.SKIP,
        persist_throttle_bytes_per_second=MiB,
    )
    committer = inline(config)
    state = training_state(width=300)  # ~1.1 MiB: ~1 s to persist
    try:
        with Checkpointer("skip", config, celery_app=committer) as ckpt:
            first = ckpt.save(state, step=1)
            buf_ptr = ckpt.staging_buffers[0].view.data_ptr()  # type: ignore[union-attr]
            second = ckpt.save(state, step=2)
            assert second.skipped and second.done()
            with pytest.raises(CheckpointFailed, match="skipped"):
                second.wait(1)
            first.wait(60)
            third = ckpt.save(state, step=3)
            assert not third.skipped
            third.wait(60)
            assert [i.step for i in ckpt.list()] == [1, 3]
            assert ckpt.staging_buffers[0].view.data_ptr() == buf_ptr  # type: ignore[union-attr]  # reused, not reallocated
            assert len(list(Path(config.host.staging_dir).glob("*.stage"))) == 1
    finally:
        committer.close()


def test_block_policy_waits_for_a_buffer_and_counts_it_in_the_stall(
    dcs_config: DCSConfig, tmp_path: Path, inline: Inline
) -> None:
    config = ckpt_config(dcs_config, tmp_path, staging_buffers=1, persist_throttle_bytes_per_second=MiB)
    committer = inline(config)
    state = training_state(width=300)
    try:
        with Checkpointer("block", config, size_hint_bytes=2 * MiB, celery_app=committer) as ckpt:
            first = ckpt.save(state, step=1)
            with pytest.raises(StagingError, match="still being persisted"):
                ckpt.save(state, step=2, timeout=0.2)
            second = ckpt.save(state, step=3, timeout=60)  # blocks until step 1 released its buffer
            # the throttled persist of step 1 takes ~1 s; a loaded machine only makes the wait longer
            assert first.released and second.stall_seconds > max(0.3, first.stall_seconds)
            second.wait(60)
    finally:
        committer.close()


def test_a_save_whose_tasks_cannot_be_sent_fails_and_hands_its_buffer_back_once(
    dcs_config: DCSConfig, tmp_path: Path
) -> None:
    """The broker (a real redis-server, on its own port) is down: the save fails with the reason and its one
    buffer is free again. The broker comes back: the next save holds that buffer while its tasks wait for a
    worker, and the failed save, polled again, does not hand back the buffer the next save now holds."""
    config = ckpt_config(dcs_config, tmp_path, staging_buffers=1, staging_policy=StagingPolicy.SKIP)
    broker = RedisServer(tmp_path / "broker", appendonly=False)  # not started yet: nothing listens on its port
    app = make_celery(config.model_copy(update={"redis_url": broker.url}))
    app.conf.update(task_publish_retry=False, result_backend=None)
    presence = Keys(config.redis.namespace).worker_presence(node_queue(config.host_name))
    client = redis.Redis.from_url(config.redis.url)
    client.set(presence, "1", ex=300)  # the persist tasks are never consumed: no worker is needed
    state = training_state()
    try:
        ckpt = Checkpointer("nosend", config, celery_app=app)
        try:
            failed = ckpt.save(state, step=1)
            with pytest.raises(CheckpointFailed, match="could not enqueue persist tasks of step 1"):
                failed.wait(60)
            wait_until(lambda: failed.poll() is not None and failed.released, 30, "the failed save's buffer")
            broker.start()
            held = ckpt.save(state, step=2)  # sent; queued for a worker that never comes: in flight
            assert not held.skipped
            wait_until(lambda: held.poll() is not None and broker.client().llen(node_queue(config.host_name)) > 0,
                       30, "step 2's tasks in the broker")  # fmt: skip
            failed.poll()
            assert ckpt.save(state, step=3).skipped  # the only buffer is still step 2's
            assert not held.released and not held.done()
        finally:
            unfinished = ckpt.close(timeout=1)
        assert unfinished == (2,)  # its staging file stays for a worker
        assert ckpt.close() == (2,)  # closing again answers at once (not after the visibility timeout)
    finally:
        client.delete(presence)
        client.close()
        broker.stop()


def test_retention_keeps_last_and_every_nth(dcs_config: DCSConfig, tmp_path: Path, inline: Inline) -> None:
    config = ckpt_config(dcs_config, tmp_path, keep_last=2, keep_every=4)
    committer = inline(config)
    try:
        with Checkpointer("keep", config, celery_app=committer) as ckpt:
            for step in range(1, 7):
                ckpt.save(training_state(seed=step), step=step).wait(60)
            wait_until(lambda: [i.step for i in ckpt.list()] == [4, 5, 6], 30, "retention to delete steps 1-3")
            assert ckpt.restore().step == 6
    finally:
        committer.close()


def _dcs(config: DCSConfig, *args: str) -> subprocess.CompletedProcess[str]:
    workdir = Path(config.checkpoint.dir).parent / "cli-output"
    return run_module("dcs_tasks.cli.main", "ckpt", *args, workdir=workdir, env=child_env(config), timeout=120)


def test_cli_list_verify_inspect_gc(dcs_config: DCSConfig, tmp_path: Path, inline: Inline) -> None:
    config = ckpt_config(dcs_config, tmp_path)
    committer = inline(config)
    try:
        with Checkpointer("cli", config, celery_app=committer) as ckpt:
            for step in (10, 20):
                info = ckpt.save(training_state(seed=step), step=step, metadata={"s": step}).wait(60)
    finally:
        committer.close()
    root = str(config.checkpoint.dir)
    listing = _dcs(config, "list", "--run", "cli", "--dir", root)
    assert listing.returncode == 0 and "20" in listing.stdout and "latest" in listing.stdout
    assert _dcs(config, "verify", "--run", "cli", "--dir", root).returncode == 0
    inspected = _dcs(config, "inspect", "--run", "cli", "--dir", root)
    assert json.loads(inspected.stdout)["metadata"] == {"s": 20}
    victim = sorted(info.path.glob("*.safetensors"))[0]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0x01
    victim.write_bytes(bytes(data))
    bad = _dcs(config, "verify", "--run", "cli", "--dir", root)
    assert bad.returncode == 1 and victim.name in bad.stderr
    victim.write_bytes(bytes(data[:-10]))  # truncated: visibly damaged without reading it
    gc = _dcs(config, "gc", "--run", "cli", "--dir", root, "--keep-last", "1")
    assert gc.returncode == 0
    # the newest step is damaged, so the newest *good* one (10) is kept along with the newest (20)
    assert "nothing to delete" in gc.stdout
    victim.unlink()
    (info.path / "manifest.json").unlink()  # step 20 is gone for readers; now step 10 is the newest
    assert _dcs(config, "gc", "--run", "cli", "--dir", root, "--keep-last", "1").stdout.strip() == "nothing to delete"
