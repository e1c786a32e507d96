"""Faults of checkpoints kept in S3, against a real S3 server (OpenStack Swift + s3api), real redis-server and real
`dcs worker` processes: a bucket quota that fills mid-save, the server restarted mid-upload, hostile listings and
objects put into the bucket behind DCS's back, a forged `latest`, and credentials kept out of every message. The
hostile listings, the forged `latest` and a file still uploading when its step fails are the store's and the
committer's behaviour: their steps are saved by an in-process committer (`inline`, the worker's code); the worker's
retries, log and start-up check run in real workers."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dcs_tasks import Checkpointer, storage
from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import CheckpointFailed, CorruptCheckpoint, StorageAccessDenied, StorageError
from tests.checkpoint_support import Inline, assert_same_state, start_worker, training_state, wait_until
from tests.helpers.preloaded import run_module
from tests.helpers.procs import WorkerProcess, child_env
from tests.storage.conftest import S3Bucket
from tests.storage.s3_support import ROOT, MiB, objects, open_uploads, s3_config

# --- helpers -----------------------------------------------------------------------------------------------------


def get(bucket: S3Bucket, key: str) -> bytes:
    return bytes(bucket.client().get_object(Bucket=bucket.bucket, Key=key)["Body"].read())


def put(bucket: S3Bucket, key: str, body: bytes) -> None:
    bucket.client().put_object(Bucket=bucket.bucket, Key=key, Body=body)


def ckpt_cli(config: DCSConfig, tmp_path: Path, *args: str) -> tuple[int, str]:
    """`dcs ckpt ARGS` as a user runs it (DCS_CHECKPOINT_DIR=s3://..., the AWS environment): (code, output); it
    never ends in a traceback."""
    done = run_module("dcs_tasks.cli.main", "ckpt", *args, workdir=tmp_path / "cli", env=child_env(config), timeout=120)
    output = done.stdout + done.stderr
    assert "Traceback" not in output, output
    return done.returncode, output


def error_chain(exc: BaseException) -> str:
    """Every message of `exc`, its causes and contexts."""
    parts: list[str] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        parts.append(f"{type(current).__name__}: {current}")
        current = current.__cause__ or current.__context__
    return "\n".join(parts)


def assert_no_secret(secret: str, *texts: str) -> None:
    assert len(secret) >= 16
    for text in texts:
        assert secret not in text, "a secret key leaked into a message or log"


@pytest.fixture
def workers() -> Iterator[list[WorkerProcess]]:
    started: list[WorkerProcess] = []
    yield started
    for w in started:
        w.discard()


# --- 1. a quota that fills mid-save ----------------------------------------------------------------------------


def test_a_full_quota_fails_the_step_cleanly_and_a_later_save_commits_once_raised(
    dcs_config: DCSConfig, tmp_path: Path, aws_env: S3Bucket, workers: list[WorkerProcess]
) -> None:
    """Quota just above what step 1 holds: step 2's 5 MiB parts cannot fit (EntityTooLarge -> StorageFull), the
    save fails naming it; no step-2 object, manifest or open upload stays; step 1 restores bit-exact; once the
    quota is raised, step 3 commits."""
    config = s3_config(dcs_config, tmp_path, aws_env, file_shard_bytes=8 * MiB)
    # one file at a time: no other file of step 2 is mid-upload when it fails (that race is the next test's)
    worker = start_worker(config, tmp_path, concurrency=1)
    workers.append(worker)
    first, second, third = (training_state(seed=s, width=1200) for s in (1, 2, 3))  # 3 files of 5.5 MiB
    run = f"{ROOT}/quota"
    with Checkpointer("quota", config) as ckpt:
        ckpt.save(first, step=1).wait(timeout=120)
        step1 = objects(aws_env, f"{run}/")
        assert any(size > 5 * MiB for size in step1.values()), step1  # at least one multipart object
        _, segments_used = aws_env.server.container_usage(aws_env.bucket + "+segments")
        _, bucket_used = aws_env.server.container_usage(aws_env.bucket)
        assert segments_used > 5 * MiB
        # room for the bucket's small objects, not for one more 5 MiB part
        aws_env.set_quota(max(segments_used, bucket_used) + 4 * MiB)

        with pytest.raises(CheckpointFailed) as failed:
            ckpt.save(second, step=2).wait(timeout=120)
        chain = error_chain(failed.value)
        assert "StorageFull" in chain and ("EntityTooLarge" in chain or "quota" in chain), chain
        assert "step-000000002" in chain, chain

        # nothing of step 2 stays: no manifest, no object, no open upload (other files may still be aborting)
        wait_until(lambda: not open_uploads(aws_env), 30, "step 2's multipart uploads to be aborted")
        wait_until(lambda: not objects(aws_env, f"{run}/step-000000002/"), 30, "step 2's partial objects to be removed")
        assert f"{run}/step-000000002/manifest.json" not in objects(aws_env)
        assert [i.step for i in ckpt.list()] == [1]
        assert get(aws_env, f"{run}/latest").decode().strip() == "step-000000001"
        restored = ckpt.restore()
        assert restored.step == 1
        assert_same_state(first, restored.state)

        aws_env.set_quota(None)
        info = ckpt.save(third, step=3).wait(timeout=120)
        assert info.step == 3
        assert [i.step for i in ckpt.list()] == [1, 3]
        assert_same_state(third, ckpt.restore().state)
        assert ckpt.close(timeout=30) == ()  # every save final, its staging buffer handed back
    assert open_uploads(aws_env) == []
    assert_no_secret(aws_env.secret_key, chain, worker.log_tail(10**7))


def test_a_file_still_uploading_when_its_step_fails_is_counted_and_the_buffer_released(
    dcs_config: DCSConfig, tmp_path: Path, aws_env: S3Bucket, inline: Inline
) -> None:
    """A small file is refused by the bucket's quota at once while a 12 MiB file of the same step is still going
    up (its parts, in the uncapped segments container, paced at 4 MiB/s: 3 s): the step fails; the big file's upload
    is then refused at its publish check and aborted. Every file must still reach an outcome, so the save's
    staging buffer is handed back and `close()` finds nothing in flight. The store's and the committer's behaviour:
    an in-process committer (`inline`, the worker's code, two threads as the worker's two processes)."""
    import torch

    config = s3_config(
        dcs_config,
        tmp_path,
        aws_env,
        file_shard_bytes=8 * MiB,
        s3_concurrency=1,
        persist_throttle_bytes_per_second=4 * MiB,
    )
    aws_env.server.set_bucket_quota(aws_env.bucket, 100, segments=False)  # single PUTs fail, parts do not
    state = {"big": torch.randn(3 * MiB), "small": torch.arange(1000, dtype=torch.int8)}
    with Checkpointer("race", config, celery_app=inline(config)) as ckpt:
        pending = ckpt.save(state, step=1)
        with pytest.raises(CheckpointFailed, match="StorageFull"):
            pending.wait(timeout=60)
        assert ckpt.close(timeout=15) == (), "a file of the failed save never finished"
        assert pending.released
    assert open_uploads(aws_env) == []
    assert objects(aws_env) == {}


# --- 2. the S3 server restarted mid-upload -------------------------------------------------------------------------


def test_the_s3_server_restarted_mid_upload_the_save_commits_bit_exact_after_it_returns(
    dcs_config: DCSConfig, tmp_path: Path, own_bucket: S3Bucket, workers: list[WorkerProcess]
) -> None:
    """The server is stopped while the parts of a 14.6 MiB file travel one at a time (4 MiB/s) and started again
    on the same port: botocore's retries and the persist task's retries carry the upload over the gap, the step
    commits bit-exact, and no upload stays open. While it was down no step was visible."""
    config = s3_config(
        dcs_config,
        tmp_path,
        own_bucket,
        persist_throttle_bytes_per_second=4 * MiB,
        file_shard_bytes=32 * MiB,
        s3_concurrency=1,
        s3_max_attempts=6,
        s3_connect_timeout_seconds=2.0,
        s3_read_timeout_seconds=10.0,
        max_retries=4,
        retry_delay_seconds=1.0,
        retry_backoff_max_seconds=4.0,
    )
    worker = start_worker(config, tmp_path)
    workers.append(worker)
    state = training_state(width=1100)  # one 14.6 MiB file: three 5 MiB parts, about 4 s at 4 MiB/s
    run = f"{ROOT}/restart"
    with Checkpointer("restart", config) as ckpt:
        pending = ckpt.save(state, step=5)
        wait_until(lambda: open_uploads(own_bucket), 30, "a multipart upload to start")
        time.sleep(0.5)  # a part or two stored, the rest still to send
        assert not pending.done() and open_uploads(own_bucket), "the restart must land mid-upload"
        own_bucket.server.stop()
        time.sleep(1.0)
        own_bucket.server.start()
        listed = ckpt.list()  # before done(): a step listed here must be the committed one
        assert listed == [] or pending.done(), listed
        info = pending.wait(timeout=150)
        assert info.step == 5
        assert [i.step for i in ckpt.list()] == [5]
        assert_same_state(state, ckpt.restore().state)
    assert open_uploads(own_bucket) == []
    manifest = json.loads(get(own_bucket, f"{run}/step-000000005/manifest.json"))
    assert sorted(objects(own_bucket, f"{run}/")) == sorted(
        [f"{run}/latest", f"{run}/step-000000005/manifest.json"]
        + [f"{run}/step-000000005/{f['name']}" for f in manifest["files"]]
    )
    assert_no_secret(own_bucket.secret_key, worker.log_tail(10**7))


# --- 3. hostile listings and objects ------------------------------------------------------------------------------


def _lying_copy(bucket: S3Bucket, run: str, manifest: dict, step: int, change: str) -> str:
    """Step `step` as a copy of step 1's objects with one lie; returns the key a reader should name."""
    src, dst = f"{run}/step-000000001", f"{run}/step-{step:09d}"
    m = json.loads(json.dumps(manifest))
    m["step"] = step
    name = m["files"][0]["name"]
    named = f"{dst}/{name}"
    for f in manifest["files"]:
        body = get(bucket, f"{src}/{f['name']}")
        if change == "size" and f["name"] == name:
            body += b"\0"  # the object is one byte longer than the manifest says
        put(bucket, f"{dst}/{f['name']}", body)
    if change == "checksum":
        m["files"][0]["checksum"] = "0" * 32 if m["files"][0]["checksum"] != "0" * 32 else "1" * 32
    elif change == "dotdot":
        m["files"][0]["name"] = "../step-000000001/" + name
        named = f"{dst}/manifest.json"
    elif change == "step":
        m["step"] = 1
        named = f"{dst}/manifest.json"
    elif change == "garbage":
        put(bucket, f"{dst}/manifest.json", b"\x00\xffnot json{" * 10)
        return f"{dst}/manifest.json"
    put(bucket, f"{dst}/manifest.json", json.dumps(m).encode())
    return named


def test_hostile_keys_and_lying_manifests_are_skipped_named_and_restore_falls_back(
    dcs_config: DCSConfig, tmp_path: Path, aws_env: S3Bucket, inline: Inline
) -> None:
    config = s3_config(dcs_config, tmp_path, aws_env)
    committer = inline(config)
    state = training_state(seed=4)
    run = f"{ROOT}/hostile"
    with Checkpointer("hostile", config, celery_app=committer) as ckpt:
        ckpt.save(state, step=1).wait(timeout=120)
    manifest = json.loads(get(aws_env, f"{run}/step-000000001/manifest.json"))
    good = get(aws_env, f"{run}/step-000000001/manifest.json")

    # keys no step may come from: dot-dot and dot components, aliases of step numbers, wrong depth, a backslash
    for key in (
        f"{run}/step-000000001/../x",
        f"{run}/step-000000009/../manifest.json",
        f"{run}/./step-000000008/manifest.json",
        f"{run}/step-+5/manifest.json",
        f"{run}/step-5/manifest.json",
        f"{run}/step-0000000007 /manifest.json",
        f"{run}/step-000000006\\manifest.json",
        f"{run}/nested/step-000000004/manifest.json",
        f"{run}/step-000000003/extra/manifest.json",
    ):
        put(aws_env, key, good)
    listed = objects(aws_env, f"{run}/")
    assert f"{run}/step-000000001/../x" in listed and f"{run}/step-+5/manifest.json" in listed  # the server kept them
    # a hostile key sorting first ("./") must not break "is there anything under the run?" (was StorageError:
    # `S3Store.objects(limit=1)` counted the skipped key, so `dcs ckpt list` ended in a traceback)
    assert sorted(listed)[0] == f"{run}/./step-000000008/manifest.json"
    run_dir = storage.root(config.checkpoint.dir, config) / "hostile"
    assert run_dir.is_dir() and run_dir.exists()

    # manifests that lie, at steps newer than the good one
    lies = {
        2: _lying_copy(aws_env, run, manifest, 2, "size"),
        3: _lying_copy(aws_env, run, manifest, 3, "checksum"),
        4: _lying_copy(aws_env, run, manifest, 4, "dotdot"),
        5: _lying_copy(aws_env, run, manifest, 5, "step"),
        6: _lying_copy(aws_env, run, manifest, 6, "garbage"),
    }
    with Checkpointer("hostile", config, celery_app=committer) as ckpt:
        assert [i.step for i in ckpt.list()] == [1, 2, 3]  # 4-6 fail their manifest checks; 2 and 3 lie about files
        with pytest.warns(RuntimeWarning) as warned:
            restored = ckpt.restore()
        assert restored.step == 1
        assert_same_state(state, restored.state)
        messages = "\n".join(str(w.message) for w in warned)
        for step, key in lies.items():
            assert f"checkpoint step {step} is corrupt" in messages, messages
            assert f"s3://{aws_env.bucket}/{key}" in messages, (key, messages)
        for step, key in lies.items():
            with pytest.raises(CorruptCheckpoint) as bad:
                ckpt.restore(step=step)
            assert f"s3://{aws_env.bucket}/{key}" in str(bad.value)
        assert "bytes, manifest says" in messages and "checksum" in messages

    code, output = ckpt_cli(config, tmp_path, "verify", "--run", "hostile")
    assert code == 1, output
    assert "step 1: ok" in output, output
    for step, key in lies.items():
        assert f"step {step}: BAD" in output and f"s3://{aws_env.bucket}/{key}" in output, (step, output)
    code, output = ckpt_cli(config, tmp_path, "list", "--run", "hostile")
    assert code == 0, output
    shown = sorted(int(line.split()[0]) for line in output.splitlines() if line.strip()[:1].isdigit())
    assert shown == [1, 2, 3, 4, 5, 6], output  # 4-6 listed as BAD, never as restorable
    for step in (4, 5, 6):
        assert any(line.split()[0] == str(step) and "BAD" in line for line in output.splitlines()), output


JUNK_KEYS = 1001


@pytest.mark.slow
def test_a_listing_of_thousands_of_junk_keys_still_finds_the_steps_and_listings_are_bounded(
    dcs_config: DCSConfig, tmp_path: Path, aws_env: S3Bucket, inline: Inline
) -> None:
    """1,001 junk keys under the run prefix, sorting before the steps (S3 lists 1,000 keys a page, so the steps'
    manifests come on the second page; Swift here creates ~60 objects/s through S3 on a 2-core machine, so the junk
    goes in through its object server, `S3Server.put_objects`, and no more of it):
    list and restore find exactly the real steps; `S3Store.objects(limit=)` refuses a longer listing, and
    `get_small` an object over its limit."""
    config = s3_config(dcs_config, tmp_path, aws_env)
    run = f"{ROOT}/junk"
    states = {s: training_state(seed=s) for s in (10, 20)}
    with Checkpointer("junk", config, celery_app=inline(config)) as ckpt:
        ckpt.save(states[10], step=10).wait(timeout=120)
        keys = [f"{run}/aaa-{i:05d}" for i in range(JUNK_KEYS)]  # they sort first: the steps are on page 2
        aws_env.server.put_objects(aws_env.bucket, keys, b"x")
        ckpt.save(states[20], step=20).wait(timeout=120)
        assert len(objects(aws_env, f"{run}/")) > JUNK_KEYS
        assert [i.step for i in ckpt.list()] == [10, 20]
        assert_same_state(states[20], ckpt.restore().state)
        assert_same_state(states[10], ckpt.restore(step=10).state)

        root = storage.root(config.checkpoint.dir, config)
        store = root.store
        assert sum(1 for _ in store.objects(f"{run}/", limit=2000)) > JUNK_KEYS
        with pytest.raises(StorageError, match=r"more than 1000 objects"):
            for _ in store.objects(f"{run}/", limit=1000):
                pass
        big = f"{run}/aaa-big"
        put(aws_env, big, b"y" * 5000)
        assert store.get_small(big, 5000) == b"y" * 5000
        with pytest.raises(CorruptCheckpoint, match="larger than 4999 bytes"):
            store.get_small(big, 4999)


# --- 4. a forged `latest` ----------------------------------------------------------------------------------------


GARBAGE_LATEST = {
    "missing-step": b"step-000000099\n",
    "dotdot": b"step-../../etc\n",
    "binary-80k": b"\xff\x00" * 40_000,
    "empty": b"",
    "older-step": b"step-000000001\n",
}


def test_a_latest_that_names_no_step_or_holds_garbage_changes_nothing(
    dcs_config: DCSConfig, tmp_path: Path, aws_env: S3Bucket, inline: Inline
) -> None:
    """`latest` only marks a step in listings; readers scan manifests. A forged one (a step that does not exist,
    a path, 80 KB of binary, empty, an older step) changes neither list nor restore, and saves still commit; a
    pointer DCS cannot read, or one naming an older step, is moved forward by the next commit."""
    config = s3_config(dcs_config, tmp_path, aws_env)
    run = f"{ROOT}/latest"
    states = {s: training_state(seed=s) for s in (1, 2, 3, 4)}
    with Checkpointer("latest", config, celery_app=inline(config)) as ckpt:
        ckpt.save(states[1], step=1).wait(timeout=120)
        ckpt.save(states[2], step=2).wait(timeout=120)
        for what, latest in GARBAGE_LATEST.items():
            put(aws_env, f"{run}/latest", latest)
            assert [i.step for i in ckpt.list()] == [1, 2], what
            restored = ckpt.restore()
            assert restored.step == 2, what
            assert_same_state(states[2], restored.state)
        put(aws_env, f"{run}/latest", GARBAGE_LATEST["binary-80k"])
        code, output = ckpt_cli(config, tmp_path, "list", "--run", "latest")
        assert code == 0 and [line.split()[0] for line in output.splitlines() if line.strip()] == ["1", "2"], output
        assert ckpt.save(states[3], step=3).wait(timeout=120).step == 3
        assert get(aws_env, f"{run}/latest").decode().strip() == "step-000000003"
        put(aws_env, f"{run}/latest", GARBAGE_LATEST["missing-step"])
        assert ckpt.save(states[4], step=4).wait(timeout=120).step == 4
        assert [i.step for i in ckpt.list()] == [1, 2, 3, 4]
        assert_same_state(states[4], ckpt.restore().state)


# --- 5. credentials stay out of messages and logs ------------------------------------------------------------------


def test_a_worker_with_a_wrong_secret_refuses_to_start_naming_the_refusal_without_printing_either_secret(
    dcs_config: DCSConfig, tmp_path: Path, aws_env: S3Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker signs with the right key id and a wrong secret (SignatureDoesNotMatch): its start-up check of the
    store refuses to start, naming the refusal as access denied; neither the wrong nor the right secret is in its
    log, and nothing reaches the bucket. (A trainer whose save meets such a worker gets NoWorkerError: none serves.)"""
    config = s3_config(dcs_config, tmp_path, aws_env)
    wrong = "W" + aws_env.secret_key[::-1] + "Zq"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", wrong)
    with pytest.raises(RuntimeError, match="refusing to start") as refused:
        start_worker(config, tmp_path)
    message = str(refused.value)
    assert "StorageAccessDenied" in message and "SignatureDoesNotMatch" in message, message
    log = (tmp_path / "worker.log").read_text(errors="replace")
    for secret in (wrong, aws_env.secret_key):
        assert_no_secret(secret, message, log)
    assert objects(aws_env) == {}


def test_dcs_ckpt_with_a_wrong_secret_prints_one_line_naming_the_refusal_and_no_secret(
    dcs_config: DCSConfig, tmp_path: Path, aws_env: S3Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = s3_config(dcs_config, tmp_path, aws_env)
    put(aws_env, f"{ROOT}/creds/step-000000001/manifest.json", b"{}")
    wrong = "W" + aws_env.secret_key[::-1] + "Zq"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", wrong)
    code, output = ckpt_cli(config, tmp_path, "list", "--run", "creds")  # asserts: no traceback
    assert code != 0 and "SignatureDoesNotMatch" in output, output
    for secret in (wrong, aws_env.secret_key):
        assert_no_secret(secret, output)


def test_a_changed_secret_under_the_same_key_id_is_used_at_once(
    dcs_config: DCSConfig, tmp_path: Path, aws_env: S3Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process whose credential environment changes gets clients signing with the new credentials, also when
    only the secret changed (a boto3 session caches what it resolved first: before the fix a process kept signing
    with the first secret it saw, so a second S3 server, or a rotated secret, was refused or silently bypassed)."""
    config = s3_config(dcs_config, tmp_path, aws_env)
    put(aws_env, f"{ROOT}/x", b"1")
    probe = storage.root(config.checkpoint.dir, config) / "x"
    assert probe.size() == 1  # resolves and caches the right credentials in this process
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "W" + aws_env.secret_key[::-1] + "Zq")
    with pytest.raises(StorageAccessDenied) as refused:
        probe.size()
    assert_no_secret(aws_env.secret_key, str(refused.value))
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", aws_env.secret_key)
    assert probe.size() == 1
