"""examples/s3_checkpoints.py against a real `dcs worker` and the S3 server: a user's shell holding the worker's
`DCS_*` settings (`DCS_CHECKPOINT_DIR=s3://...`, the endpoint) and the bucket owner's AWS credentials."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from dcs_tasks.config import DCSConfig
from tests.checkpoint_support import start_worker
from tests.helpers.procs import REPO, child_env
from tests.storage.conftest import S3Bucket
from tests.storage.s3_support import objects, s3_config


def test_the_s3_example_saves_lists_and_restores_bit_exact(
    dcs_config: DCSConfig, tmp_path: Path, aws_env: S3Bucket
) -> None:
    config = s3_config(dcs_config, tmp_path, aws_env)
    worker = start_worker(config, tmp_path)
    try:
        command = [sys.executable, str(REPO / "examples" / "s3_checkpoints.py"), "--run", "example-s3"]
        done = subprocess.run(command, env=child_env(config), cwd=REPO, capture_output=True, text=True, timeout=300)
    finally:
        worker.discard()
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert (
        "committed: [10, 20, 30]" in done.stdout and "restored step 30 into the model; bit-exact: True" in done.stdout
    )
    assert f"step 30: {aws_env.url('fleet/ckpt/example-s3/step-000000030')}" in done.stdout, done.stdout
    assert any(key.startswith("fleet/ckpt/example-s3/step-000000030/") for key in objects(aws_env))
