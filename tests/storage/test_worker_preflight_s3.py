"""With `DCS_CHECKPOINT_DIR=s3://...`, `dcs worker` checks at start that its credentials may list, put and delete
under the root and that the bucket exists, and refuses to start naming the error (as met: a worker with wrong S3
credentials started, and every save failed in its log only). `dcs doctor` runs the same check (read-only) from
the trainer's environment. Real worker processes, the real S3 server of tests/storage/conftest.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dcs_tasks.config import DCSConfig
from tests.helpers.procs import REPO, WorkerProcess
from tests.storage.conftest import S3Bucket
from tests.storage.s3_support import s3_config

pytestmark = pytest.mark.integration


def refused_start(config: DCSConfig, tmp_path: Path) -> str:
    worker = WorkerProcess(config, tmp_path / "worker.log")
    try:
        with pytest.raises(RuntimeError, match="worker exited with 1") as caught:
            worker.start(timeout=90)
    finally:
        worker.discard()
    return str(caught.value)


def test_a_worker_with_wrong_s3_credentials_refuses_to_start_naming_access_denied(
    dcs_config: DCSConfig, tmp_path: Path, aws_env: S3Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = s3_config(dcs_config, tmp_path, aws_env)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", aws_env.server.other_access_key)  # a user without rights on the bucket
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", aws_env.server.other_secret_key)
    log = refused_start(config, tmp_path)
    assert "StorageAccessDenied" in log and str(config.checkpoint.dir) in log, log
    assert "AWS_ACCESS_KEY_ID" in log, log  # the fix names the credentials to check
    assert aws_env.server.other_secret_key not in log


def test_a_worker_on_a_missing_bucket_refuses_to_start_naming_it(
    dcs_config: DCSConfig, tmp_path: Path, aws_env: S3Bucket
) -> None:
    config = s3_config(dcs_config, tmp_path, aws_env).model_copy(
        update={"checkpoint_dir": DCSConfig(checkpoint_dir="s3://no-such-bucket-dcs/x").checkpoint.dir}
    )
    log = refused_start(config, tmp_path)
    assert "s3://no-such-bucket-dcs" in log and ("StorageNotFound" in log or "NoSuchBucket" in log), log


def test_doctor_reports_the_trainers_wrong_s3_credentials(
    dcs_config: DCSConfig, tmp_path: Path, aws_env: S3Bucket
) -> None:
    config = s3_config(dcs_config, tmp_path, aws_env)
    env = {**os.environ, **config.to_env(), "PYTHONPATH": str(REPO)}
    env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"] = "AKIDWRONG", "wrong-secret-value"
    argv = [sys.executable, "-m", "dcs_tasks.cli.main", "doctor"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAIL  object store reachable" in done.stdout and "StorageAccessDenied" in done.stdout, done.stdout
    assert "wrong-secret-value" not in done.stdout + done.stderr
