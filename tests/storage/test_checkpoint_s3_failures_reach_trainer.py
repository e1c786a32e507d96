"""S3 save failures reach the trainer, against a real S3 server (OpenStack Swift + s3api), real redis-server and real
`dcs worker` processes: credentials S3 refuses to the worker end the README's own trainer with SaveFailed naming the
refusal (it used to exit 0 with nothing saved), and an S3 outage mid-run costs the saves made while it lasts, not
the training run: no exception from `save()`, a warning and `dcs_ckpt_save_failures_total{kind="storage_unavailable"}`,
and the next save after the server is back commits. The outage tests are the trainer's behaviour: their saves go
through an in-process committer (`inline`, the worker's code and retry policy); the worker's own retries over a
restart are tested with a real worker in test_checkpoint_s3_faults.py."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from dcs_tasks import Checkpointer
from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import CheckpointFailed
from tests.checkpoint_support import Inline, start_worker, training_state, wait_until
from tests.helpers.procs import WorkerProcess
from tests.helpers.shm import shm_dir
from tests.integration.readme_trainer import failures_counted, run_readme_trainer, trainer_env
from tests.storage.conftest import S3Bucket
from tests.storage.s3_support import ROOT, MiB, objects, open_uploads, s3_config


@pytest.fixture
def workers() -> Iterator[list[WorkerProcess]]:
    started: list[WorkerProcess] = []
    yield started
    for w in started:
        w.discard()


def share_bucket(bucket: S3Bucket, user: str, *, grant: bool) -> None:
    """Grant (or revoke) `user` reading and writing `bucket`, multipart parts included (Swift container ACLs, set
    by the owner): what a bucket policy change does to a worker's credentials."""
    token, storage_url = bucket.server.swift_token()
    verify = bucket.server.ca_bundle or True
    with httpx.Client(timeout=10, verify=verify) as client:
        for container in (bucket.bucket, f"{bucket.bucket}+segments"):
            if grant:
                headers = {"X-Auth-Token": token, "X-Container-Read": user, "X-Container-Write": user}
                client.put(f"{storage_url}/{container}", headers=headers).raise_for_status()
            else:
                headers = {"X-Auth-Token": token, "X-Remove-Container-Read": "x", "X-Remove-Container-Write": "x"}
                client.post(f"{storage_url}/{container}", headers=headers).raise_for_status()


def test_the_readme_trainer_fails_naming_the_refusal_when_s3_refuses_the_workers_credentials(
    dcs_config: DCSConfig,
    tmp_path: Path,
    aws_env: S3Bucket,
    monkeypatch: pytest.MonkeyPatch,
    workers: list[WorkerProcess],
) -> None:
    """The worker signs as a user the bucket stopped granting writes after the worker started (its start-up check
    passed), the trainer as the owner: every upload is refused (StorageAccessDenied). The README trainer used to
    exit 0 with nothing saved; now its next save raises SaveFailed naming step 0 and the refusal, no secret in it."""
    config = s3_config(dcs_config, tmp_path, aws_env, root="fleet")
    server = aws_env.server
    share_bucket(aws_env, server.other_access_key, grant=True)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", server.other_access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", server.other_secret_key)
    workers.append(start_worker(config, tmp_path))
    share_bucket(aws_env, server.other_access_key, grant=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", aws_env.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", aws_env.secret_key)
    trainer_env(monkeypatch, config)
    run = run_readme_trainer(steps=250)
    assert isinstance(run.raised, CheckpointFailed), f"ended by {run.raised!r}, close() returned {run.closed!r}"
    message = str(run.raised)
    assert getattr(run.raised, "step", None) == 0, message
    assert getattr(run.raised, "error_type", None) == "StorageAccessDenied", message
    assert "step 0 of run 'exp1'" in message
    assert server.other_secret_key not in message and aws_env.secret_key not in message
    print(f"StorageAccessDenied of step 0 raised after {run.steps_trained} steps, {run.seconds_after_save(0):.2f} s")
    assert objects(aws_env) == {}


def test_an_s3_outage_mid_run_fails_only_the_saves_made_during_it_and_the_next_save_commits(
    dcs_config: DCSConfig,
    tmp_path: Path,
    own_bucket: S3Bucket,
    inline: Inline,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The S3 server stops between two saves: the save made while it is down raises nothing (it used to raise
    StorageUnavailable out of `save()`, ending the training run); its handle's wait() says why, a warning names
    the step, the counter counts it. Once the server is back, the next save commits, and close() lists the lost
    step as failed, none as unfinished, and raises nothing."""
    config = s3_config(
        dcs_config,
        tmp_path,
        own_bucket,
        s3_max_attempts=2,
        s3_connect_timeout_seconds=1.0,
        max_retries=1,
    )
    state = training_state()
    before = failures_counted("storage_unavailable")
    caplog.set_level(logging.WARNING)
    with Checkpointer("outage", config, celery_app=inline(config)) as ckpt:
        ckpt.save(state, step=1).wait(timeout=60)
        own_bucket.server.stop()
        started = time.monotonic()
        lost = ckpt.save(state, step=2)  # storage is down: this save is lost, training is not
        stall = time.monotonic() - started
        with pytest.raises(CheckpointFailed, match="StorageUnavailable"):
            lost.wait(timeout=60)
        assert failures_counted("storage_unavailable") - before == 1
        logged = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("step 2 of run 'outage' was not saved: storage unavailable" in m for m in logged), logged
        own_bucket.server.start()
        info = ckpt.save(state, step=3).wait(timeout=120)  # the next save tries again, and commits
        assert info.step == 3
        closed = ckpt.close()
    print(f"save() during the outage returned after {stall:.2f} s without raising")
    assert closed.failed == (2,) and closed.unfinished == () and closed.failures[0].transient
    assert sorted(
        k.rsplit("/", 2)[-2] for k in objects(own_bucket, f"{ROOT}/outage/") if k.endswith("manifest.json")
    ) == [
        "step-000000001",
        "step-000000003",
    ]


def test_an_upload_the_committer_gives_up_on_while_s3_is_down_is_warned_not_raised(
    dcs_config: DCSConfig,
    tmp_path: Path,
    own_bucket: S3Bucket,
    inline: Inline,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The server stops while the committer uploads a step (throttled: about 4 s) and stays down until it gives up
    on it (StorageUnavailable after the worker's retry policy, `dcs_tasks.retrypolicy`; an in-process committer, the
    worker's code): the step fails in the ledger, and the trainer's next save, once the server is back, raises
    nothing for it (storage was down, nothing to fix) and commits; close() lists it. The persist was tried again
    `max_retries` times (1) before it gave up."""
    config = s3_config(
        dcs_config,
        tmp_path,
        own_bucket,
        persist_throttle_bytes_per_second=4 * MiB,
        file_shard_bytes=32 * MiB,
        s3_concurrency=1,
        s3_max_attempts=2,
        s3_connect_timeout_seconds=1.0,
        max_retries=1,
    )
    state = training_state(width=1100)  # one 14.6 MiB file
    caplog.set_level(logging.WARNING, logger="dcs_tasks.checkpoint.inline")
    with Checkpointer("gaveup", config, celery_app=inline(config)) as ckpt:
        lost = ckpt.save(state, step=1)
        wait_until(lambda: open_uploads(own_bucket), 30, "a multipart upload to start")
        own_bucket.server.stop()
        wait_until(lost.done, 120, "the committer to give up on step 1")
        own_bucket.server.start()
        # no SaveFailed for step 1: storage was down (a small state: this save need not be slow)
        info = ckpt.save(training_state(seed=2), step=2).wait(timeout=120)
        assert info.step == 2
        closed = ckpt.close()
    assert closed.failed == (1,) and closed.unfinished == ()
    failure = closed.failures[0]
    assert failure.transient and failure.error_type == "StorageUnavailable", failure
    assert "persisting" in failure.reason, failure.reason
    retries = [r.getMessage() for r in caplog.records if ": retry " in r.getMessage() and "step 1" in r.getMessage()]
    assert len(retries) == 1 and "retry 1 in" in retries[0], retries


def test_a_memory_tier_step_whose_copy_to_s3_is_refused_is_raised_at_the_next_save(
    dcs_config: DCSConfig,
    tmp_path: Path,
    aws_env: S3Bucket,
    monkeypatch: pytest.MonkeyPatch,
    workers: list[WorkerProcess],
) -> None:
    """Memory tier on, S3 refuses the worker's uploads (its grant was revoked after it started): step 1 commits in
    memory, and its copy to storage fails for good (StorageAccessDenied). That used to be a line in the worker's log
    only; now the trainer's next save raises SaveFailed naming step 1, that it is in memory only, and the refusal."""
    config = s3_config(
        dcs_config, tmp_path, aws_env, memory_tier_bytes=64 * MiB, memory_dir=shm_dir(tmp_path) / "memory"
    )
    server = aws_env.server
    share_bucket(aws_env, server.other_access_key, grant=True)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", server.other_access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", server.other_secret_key)
    workers.append(start_worker(config, tmp_path))
    share_bucket(aws_env, server.other_access_key, grant=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", aws_env.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", aws_env.secret_key)
    state = training_state()
    with Checkpointer("memflush", config) as ckpt:
        info = ckpt.save(state, step=1, durable=True).wait(timeout=60)  # committed in memory
        assert info.path == Path(config.host.memory_dir) / "memflush" / "step-000000001"

        error = None
        for step in range(2, 40):  # each save looks for the failed copy; it comes within a few seconds
            try:
                ckpt.save(state, step=step, durable=False).wait(timeout=60)
            except CheckpointFailed as exc:  # SaveFailed
                error = exc
                break
            time.sleep(0.5)
        assert error is not None, "no save reported the failed copy to storage"
        assert type(error).__name__ == "SaveFailed", repr(error)
        assert getattr(error, "step", None) == 1, str(error)
        assert getattr(error, "error_type", None) == "StorageAccessDenied", str(error)
        assert "in memory only" in str(error) and server.other_secret_key not in str(error)
    assert objects(aws_env) == {}
