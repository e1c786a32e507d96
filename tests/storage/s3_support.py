"""What the S3 checkpoint tests share: the AWS environment for a bucket, a DCS config on it, and listings read
back with the owner's boto3 client."""

from __future__ import annotations

from pathlib import Path

import pytest

from dcs_tasks.config import DCSConfig
from tests.checkpoint_support import ckpt_config
from tests.storage.conftest import S3Bucket

MiB = 1024 * 1024
ROOT = "fleet/ckpt"


def use_bucket(bucket: S3Bucket, monkeypatch: pytest.MonkeyPatch) -> S3Bucket:
    """The bucket owner's credentials in the standard AWS variables: this process (the trainer) and the workers
    it starts (they inherit the environment) find them through boto3's chain."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", bucket.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", bucket.secret_key)
    monkeypatch.setenv("AWS_DEFAULT_REGION", bucket.region)
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_CA_BUNDLE"):
        monkeypatch.delenv(name, raising=False)
    if bucket.server.ca_bundle:
        monkeypatch.setenv("AWS_CA_BUNDLE", str(bucket.server.ca_bundle))
    return bucket


def s3_config(
    dcs_config: DCSConfig, tmp_path: Path, bucket: S3Bucket, root: str = ROOT, **overrides: object
) -> DCSConfig:
    """The test config with `checkpoint_dir=s3://<bucket>/<root>`, small parts and few retries."""
    values: dict[str, object] = {
        "checkpoint_dir": DCSConfig.model_validate({"checkpoint_dir": bucket.url(root)}).checkpoint.dir,
        "s3_endpoint_url": bucket.endpoint_url,
        "s3_addressing_style": "path",
        "s3_part_bytes": 5 * MiB,
        "s3_concurrency": 4,
        "s3_max_attempts": 3,
        "keep_last": None,
    }
    values.update(overrides)
    return ckpt_config(dcs_config, tmp_path, **values)


def objects(bucket: S3Bucket, prefix: str = "") -> dict[str, int]:
    """Key -> size of every object under `prefix`."""
    found: dict[str, int] = {}
    for page in bucket.client().get_paginator("list_objects_v2").paginate(Bucket=bucket.bucket, Prefix=prefix):
        found.update({item["Key"]: item["Size"] for item in page.get("Contents", [])})
    return found


def open_uploads(bucket: S3Bucket) -> list[str]:
    """Keys of the multipart uploads still open in the bucket."""
    answer = bucket.client().list_multipart_uploads(Bucket=bucket.bucket)
    return [u["Key"] for u in answer.get("Uploads", [])]
