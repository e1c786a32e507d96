"""The S3 client's transfer paths against the real server (Swift + s3api): uploads that lend the staging
mapping's bytes to botocore without copies, ranged GETs read straight into the destination, and the checks
that a step may still be written, which run beside an upload and abort it when they refuse."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest
import xxhash

from dcs_tasks import storage
from dcs_tasks.checkpoint.format.layout import MANIFEST_NAME
from dcs_tasks.checkpoint.persisting import step_guard
from dcs_tasks.checkpoint.store.ledger.incremental import RETIRED_NAME
from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import CheckpointFailed, CorruptCheckpoint
from dcs_tasks.storage import ObjectPath
from dcs_tasks.storage.s3 import _direct_stream
from tests.storage.conftest import S3Bucket
from tests.storage.s3_support import MiB, objects, open_uploads, s3_config


def _root(dcs_config: DCSConfig, tmp_path: Path, bucket: S3Bucket) -> ObjectPath:
    config = s3_config(dcs_config, tmp_path, bucket)
    location = storage.root(config.checkpoint.dir, config)
    assert isinstance(location, ObjectPath)
    return location


def test_an_upload_from_a_mapping_stores_its_bytes_and_leaves_the_mapping_closable(
    dcs_config: DCSConfig, tmp_path: Path, aws_env: S3Bucket
) -> None:
    """Parts go out as slices of the caller's mapping: the object holds exactly its bytes, the checksum is of
    those bytes, and the mapping closes afterwards (no slice still lent: mmap.close would raise BufferError)."""
    root = _root(dcs_config, tmp_path, aws_env)
    data = os.urandom(13 * MiB + 12345)  # three 5 MiB parts, the last one short
    mapping = mmap.mmap(-1, len(data))
    mapping.write(data)
    hasher = xxhash.xxh3_128()
    target = root / "run" / "blob"
    with memoryview(mapping) as view:
        target.store.upload(target.key, view, hasher)
    mapping.close()  # BufferError here if the upload kept a view of it
    assert hasher.hexdigest() == xxhash.xxh3_128(data).hexdigest()
    stored = aws_env.client().get_object(Bucket=aws_env.bucket, Key=target.key)["Body"].read()
    assert stored == data


def test_ranged_reads_land_in_the_destination_and_a_short_object_is_named(
    dcs_config: DCSConfig, tmp_path: Path, aws_env: S3Bucket
) -> None:
    root = _root(dcs_config, tmp_path, aws_env)
    data = os.urandom(3 * MiB + 7)
    target = root / "run" / "ranged"
    aws_env.client().put_object(Bucket=aws_env.bucket, Key=target.key, Body=data)
    # the installed botocore/urllib3 still expose the http.client response: reads skip urllib3's copy (if an
    # upgrade hides it, reads still work through botocore, only slower: this says so)
    body = target.store.client.get_object(Bucket=aws_env.bucket, Key=target.key, Range="bytes=0-9")["Body"]
    assert _direct_stream(body) is not None
    body.close()
    for _ in range(3):  # the connection a finished read gives back serves the next GET
        first, second = bytearray(1 * MiB), bytearray(2 * MiB)
        target.store.read_into(target.key, 5, [memoryview(first), memoryview(second)])
        assert bytes(first) + bytes(second) == data[5 : 5 + 3 * MiB]
    past = bytearray(3 * MiB)
    with pytest.raises(CorruptCheckpoint, match="ended early"):
        target.store.read_into(target.key, 1 * MiB, [memoryview(past)])  # 2 MiB + 7 left, 3 MiB asked
    again = bytearray(7)
    target.store.read_into(target.key, 3 * MiB, [memoryview(again)])  # the dropped connection is not reused
    assert bytes(again) == data[3 * MiB :]


@pytest.mark.parametrize("marker", [MANIFEST_NAME, RETIRED_NAME])
def test_an_upload_into_a_committed_or_retired_step_is_aborted_and_nothing_changes(
    dcs_config: DCSConfig, tmp_path: Path, aws_env: S3Bucket, marker: str
) -> None:
    """The worker's checks (a manifest: the ledger forgot a committed step; a `.retired` marker: a deleted step
    later steps use) run while the parts travel; their refusal comes before the object appears, the upload is
    aborted, and what the step held keeps its bytes."""
    root = _root(dcs_config, tmp_path, aws_env)
    step = root / "run" / "step-000000007"
    kept = os.urandom(1000)
    client = aws_env.client()
    client.put_object(Bucket=aws_env.bucket, Key=(step / marker).key, Body=b"{}")
    client.put_object(Bucket=aws_env.bucket, Key=(step / "model.safetensors").key, Body=kept)
    before = objects(aws_env, step.key + "/")
    guard = step_guard(step)

    def publish() -> bool:
        guard()
        return True

    data = os.urandom(11 * MiB)  # a multipart upload: the refusal must abort it
    target = step / "model.safetensors"
    with memoryview(data) as view, pytest.raises(CheckpointFailed, match=r"already committed|later steps use"):
        target.store.upload(target.key, view, xxhash.xxh3_128(), publish=publish)
    assert objects(aws_env, step.key + "/") == before
    assert client.get_object(Bucket=aws_env.bucket, Key=target.key)["Body"].read() == kept
    assert open_uploads(aws_env) == []


def test_a_clean_step_passes_its_checks(dcs_config: DCSConfig, tmp_path: Path, aws_env: S3Bucket) -> None:
    root = _root(dcs_config, tmp_path, aws_env)
    step = root / "run" / "step-000000008"
    step_guard(step)()  # nothing stored under it: no refusal
    data = os.urandom(6 * MiB)
    target = step / "model.safetensors"
    guard = step_guard(step)
    with memoryview(data) as view:
        target.store.upload(target.key, view, xxhash.xxh3_128(), publish=lambda: guard() is None)
    assert objects(aws_env, step.key + "/") == {target.key: len(data)}
