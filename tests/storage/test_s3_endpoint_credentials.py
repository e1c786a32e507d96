"""A `user:password@` in DCS_S3_ENDPOINT_URL stays out of every storage error and log line, against a real S3
server (OpenStack Swift + s3api), real redis-server and a real `dcs worker`: while the server answers nothing
changes (S3 requests are signed with the AWS credentials; the URL's userinfo was never used), and when it is down
the errors name the operation and the unreachable endpoint with the password masked, in the trainer's exception,
the worker's log, `dcs ckpt`'s output and botocore's own debug log."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from dcs_tasks import Checkpointer
from dcs_tasks.celery_app import node_queue
from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import CheckpointFailed, SettingsMismatch, StorageUnavailable
from dcs_tasks.keys import Keys
from dcs_tasks.redisconn import sync_client
from dcs_tasks.storage import ObjectURL, S3Store, parse_root
from dcs_tasks.storage.s3 import S3Settings
from tests.checkpoint_support import start_worker, training_state, wait_until
from tests.helpers.preloaded import run_module
from tests.helpers.procs import WorkerProcess, child_env
from tests.helpers.s3server import S3Server
from tests.storage.conftest import S3Bucket, new_bucket
from tests.storage.s3_support import MiB, open_uploads, s3_config, use_bucket

PASSWORD = "endpoint-Pw-9f3c7e21a"


@pytest.fixture
def own_bucket(own_s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Bucket:
    """A bucket on a private S3 server this test may stop; its endpoint URL carries a user and a password."""
    endpoint = own_s3_server.endpoint_url.replace("://", f"://dcs:{PASSWORD}@", 1)
    return use_bucket(new_bucket(own_s3_server, "dcs-endpoint", endpoint), monkeypatch)


@pytest.fixture
def workers() -> Iterator[list[WorkerProcess]]:
    started: list[WorkerProcess] = []
    yield started
    for w in started:
        w.discard()


def error_chain(exc: BaseException) -> str:
    """Every message of `exc`, its causes and contexts (a suppressed context included)."""
    parts: list[str] = []
    current: BaseException | None = exc
    while current is not None and len(parts) < 20:
        parts.append(f"{type(current).__name__}: {current}")
        current = current.__cause__ or current.__context__
    return "\n".join(parts)


def test_the_store_works_and_its_errors_and_debug_log_never_carry_the_password(
    own_bucket: S3Bucket, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)  # botocore's debug log prints every request's URL
    settings = S3Settings(endpoint_url=own_bucket.endpoint_url, addressing_style="path", max_attempts=2)
    url = parse_root(own_bucket.url("run"))
    assert isinstance(url, ObjectURL)
    store = S3Store(url, settings)
    store.put_small("run/a", b"bytes")
    assert store.get_small("run/a", 100) == b"bytes" and store.head("run/a") == 5
    own_bucket.server.stop()
    failures = []
    for call in (
        lambda: store.head("run/a"),
        lambda: store.put_small("run/b", b"x"),
        lambda: list(store.objects("run/")),
    ):
        with pytest.raises(StorageUnavailable) as raised:
            call()
        failures.append(error_chain(raised.value))
    for chain in failures:
        assert "EndpointConnectionError" in chain and f"s3://{own_bucket.bucket}/run" in chain, chain
        assert PASSWORD not in chain, chain
    assert caplog.records and PASSWORD not in caplog.text, [r for r in caplog.text.splitlines() if PASSWORD in r][:3]


def test_a_save_and_dcs_ckpt_during_an_outage_name_it_without_the_password(
    dcs_config: DCSConfig, tmp_path: Path, own_bucket: S3Bucket, workers: list[WorkerProcess]
) -> None:
    """The server stops while the worker uploads a step (one 14.6 MiB file at 4 MiB/s, so the outage lands
    mid-upload): the save fails as StorageUnavailable in the worker, and neither the trainer's exception, the
    worker's log nor `dcs ckpt list` (run after it) carries the password."""
    config = s3_config(
        dcs_config,
        tmp_path,
        own_bucket,
        persist_throttle_bytes_per_second=4 * MiB,
        file_shard_bytes=32 * MiB,
        s3_concurrency=1,
        s3_max_attempts=2,
        s3_connect_timeout_seconds=1.0,
        max_retries=0,
    )
    worker = start_worker(config, tmp_path)
    workers.append(worker)
    with Checkpointer("endpoint", config) as ckpt:
        pending = ckpt.save(training_state(width=1100), step=1)
        wait_until(lambda: open_uploads(own_bucket), 30, "the upload to start")  # the endpoint works as before
        own_bucket.server.stop()
        with pytest.raises(CheckpointFailed, match="StorageUnavailable") as failed:
            pending.wait(timeout=120)
        ckpt.close()
    listed = run_module(
        "dcs_tasks.cli.main",
        "ckpt",
        "list",
        "--run",
        "endpoint",
        workdir=tmp_path / "cli",
        env=child_env(config),
        timeout=120,
    )
    output = listed.stdout + listed.stderr
    assert listed.returncode != 0 and "EndpointConnectionError" in output, output
    log = worker.log_tail(10**7)
    assert "StorageUnavailable" in log, log[-3000:]
    for text in (error_chain(failed.value), output, log):
        assert PASSWORD not in text, [line for line in text.splitlines() if PASSWORD in line][:3]


def test_a_settings_mismatch_over_the_endpoint_names_it_without_the_password(
    dcs_config: DCSConfig, tmp_path: Path, own_bucket: S3Bucket, workers: list[WorkerProcess]
) -> None:
    """The worker publishes the endpoint it uses (in Redis, for trainers to compare) and a trainer that uses
    another refuses to start naming both: neither the record nor the message carries the password."""
    config = s3_config(dcs_config, tmp_path, own_bucket)
    workers.append(start_worker(config, tmp_path))
    raw = sync_client(config).get(Keys(config.redis.namespace).worker_settings(node_queue(config.host_name)))
    published = raw.decode() if isinstance(raw, bytes) else str(raw)
    assert PASSWORD not in published and own_bucket.server.endpoint_url in published, published
    elsewhere = str(own_bucket.endpoint_url).replace("127.0.0.1", "localhost")
    with pytest.raises(SettingsMismatch, match="s3_endpoint_url") as refused:
        Checkpointer("endpoint", config.model_copy(update={"s3_endpoint_url": elsewhere}))
    assert PASSWORD not in error_chain(refused.value), error_chain(refused.value)
