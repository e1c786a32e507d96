"""docs/reliability.md faults 1, 4, 5, 8, 9 and 'no worker' against real Redis and real `dcs worker` processes (the
corrupt and truncated files, a reader's fault, saved by an in-process committer: the worker's code)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import redis

from dcs_tasks import Checkpointer
from dcs_tasks.celery_app import TaskName, make_celery, node_queue
from dcs_tasks.checkpoint.restore.reader import load_manifest, verify_step
from dcs_tasks.checkpoint.store.ledger.stepledger import StepLedger
from dcs_tasks.checkpoint.store.payloads import CommitRequest, PersistRequest, StepRef
from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import CheckpointError, CorruptCheckpoint, NoWorkerError
from dcs_tasks.keys import Keys
from tests.checkpoint_support import Inline, assert_same_state, ckpt_config, start_worker, training_state

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MiB = 1 << 20


def _temps(step_dir: Path) -> list[Path]:
    return list(step_dir.glob(".*.tmp")) if step_dir.exists() else []


def test_save_without_worker_fails_at_once(dcs_config: DCSConfig, tmp_path: Path) -> None:
    with Checkpointer("noworker", ckpt_config(dcs_config, tmp_path)) as ckpt:
        with pytest.raises(NoWorkerError, match=r"dcs\.node\.testhost"):
            ckpt.save(training_state(), step=1)


def test_corrupt_and_truncated_files_are_named_and_restore_falls_back(
    dcs_config: DCSConfig, tmp_path: Path, inline: Inline
) -> None:
    config = ckpt_config(dcs_config, tmp_path)
    committer = inline(config)
    try:
        with Checkpointer("corrupt", config, celery_app=committer) as ckpt:
            good, newer = training_state(seed=1), training_state(seed=2)
            ckpt.save(good, step=1).wait(60)
            info = ckpt.save(newer, step=2).wait(60)
            victim = sorted(info.path.glob("*.safetensors"))[0]
            data = bytearray(victim.read_bytes())
            data[len(data) // 2] ^= 0xFF
            victim.write_bytes(bytes(data))
            with pytest.raises(CorruptCheckpoint, match=victim.name) as err:
                ckpt.restore(step=2)
            assert err.value.path == str(victim)
            with pytest.warns(RuntimeWarning, match="step 2 is corrupt"):
                restored = ckpt.restore()
            assert restored.step == 1
            assert_same_state(good, restored.state)
            victim.write_bytes(bytes(data[:100]))
            with pytest.raises(CorruptCheckpoint, match="has 100 bytes"):
                verify_step(info.path, load_manifest(info.path))
    finally:
        committer.close()


def test_duplicate_and_stale_deliveries_change_nothing(dcs_config: DCSConfig, tmp_path: Path) -> None:
    config = ckpt_config(dcs_config, tmp_path)
    worker = start_worker(config, tmp_path)
    app = make_celery(config)
    queue = node_queue(config.host_name)
    try:
        with Checkpointer("dup", config) as ckpt:
            info = ckpt.save(training_state(), step=3).wait(60)
            token = StepLedger(make_redis(config), Keys(config.redis.namespace)).read("dup", 3).token
            before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in info.path.iterdir()}
            manifest = load_manifest(info.path)
            for tok in (token, "0" * 32):  # a duplicate of this save, and a stale task of another attempt
                ref = StepRef(run="dup", step=3, token=tok, step_dir=str(info.path))
                for f in manifest.files:
                    gone = str(Path(config.host.staging_dir) / f"dcs-{config.redis.namespace}-dup-1-0123abcd-0.stage")
                    req = PersistRequest(ref=ref, file_name=f.name, staging_path=gone, offset=0, length=f.size)
                    answer = app.send_task(TaskName.PERSIST.value, args=[req.model_dump(mode="json")], queue=queue)
                    assert answer.get(timeout=30) in ("done", "stale")
                commit = CommitRequest(ref=ref).model_dump(mode="json")
                answer = app.send_task(TaskName.COMMIT.value, args=[commit], queue=queue)
                assert answer.get(timeout=30) in ("done", "stale")
            after = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in info.path.iterdir()}
            assert after == before
            verify_step(info.path, load_manifest(info.path))
    finally:
        worker.discard()


def make_redis(config: DCSConfig) -> redis.Redis:
    return redis.Redis.from_url(config.redis.url, decode_responses=True)


def _draft(run: str, step: int, created_at: float) -> Any:
    from dcs_tasks.checkpoint.format.layout import ManifestDraft

    return ManifestDraft(run=run, step=step, tensors={}, structure={"k": "v", "v": None}, created_at=created_at)


def test_a_save_whose_trainer_died_before_sending_is_taken_over_later(dcs_config: DCSConfig, tmp_path: Path) -> None:
    """A trainer killed between opening a step and sending its tasks leaves it PERSISTING with nobody to
    finish it: a re-save of that step is refused while such an attempt could still be alive, and takes it
    over once it cannot (it was stuck for the 7-day ledger TTL before)."""
    config = ckpt_config(dcs_config, tmp_path)
    book = StepLedger(make_redis(config), Keys(config.redis.namespace))
    age = config.abandoned_save_seconds()
    assert book.begin("died", 5, "a" * 32, 1, _draft("died", 5, time.time() - 60), age).value == "write"
    assert book.begin("died", 6, "b" * 32, 1, _draft("died", 6, time.time() - age - 60), age).value == "write"
    worker = start_worker(config, tmp_path)
    state = training_state()
    try:
        with Checkpointer("died", config) as ckpt:
            with pytest.raises(CheckpointError, match="step 5 of run 'died' is still being persisted"):
                ckpt.save(state, step=5)
            ckpt.save(state, step=6).wait(60)  # the attempt begun long ago is taken over
            assert_same_state(state, ckpt.restore(step=6).state)
    finally:
        worker.discard()


def test_an_abandoned_attempt_fails_and_frees_its_step(dcs_config: DCSConfig) -> None:
    """What the trainer does when it cannot send every persist task: the step fails with the reason and can
    be saved again at once; a stale token cannot abandon a newer attempt."""
    book = StepLedger(make_redis(dcs_config), Keys(dcs_config.redis.namespace))
    age = dcs_config.abandoned_save_seconds()
    assert book.begin("send", 1, "a" * 32, 2, _draft("send", 1, time.time()), age).value == "write"
    assert book.abandon("send", 1, "z" * 32, "not mine").value == "stale"
    assert book.abandon("send", 1, "a" * 32, "broker unreachable").value == "ok"
    state = book.read("send", 1)
    assert state.status is not None and state.status.value == "failed" and state.reason == "broker unreachable"
    assert 1 not in book.in_flight_steps("send")
    assert book.begin("send", 1, "c" * 32, 2, _draft("send", 1, time.time()), age).value == "write"
