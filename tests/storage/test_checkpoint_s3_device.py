"""Restores from S3 into device tensors: the ring of `dcs_tasks/checkpoint/restore/device.py` filled by ranged GETs,
a corrupt object failing its step and the restore falling back. On CPU with the test runtime of
tests/helpers/fakedevice.py; the `gpu` test does the same into CUDA tensors (skipped without CUDA)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dcs_tasks import Checkpointer
from dcs_tasks.checkpoint.inline import InlineCommitter
from dcs_tasks.checkpoint.restore.device import DeviceRestorer
from dcs_tasks.config import DCSConfig
from tests.checkpoint_support import Inline
from tests.helpers.fakedevice import FakeCopier
from tests.storage.conftest import S3Bucket
from tests.storage.s3_support import s3_config

SLOT = 256 * 1024


def state(seed: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(700, 500, generator=g).to(torch.bfloat16).to(device),
        "m": torch.randn(200_000, generator=g).to(device),
    }


def corrupt_newest(bucket: S3Bucket, prefix: str) -> None:
    client = bucket.client()
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket.bucket, Prefix=prefix)["Contents"]]
    key = max(k for k in keys if k.endswith(".safetensors"))
    body = bytearray(client.get_object(Bucket=bucket.bucket, Key=key)["Body"].read())
    body[-2] ^= 0xFF
    client.put_object(Bucket=bucket.bucket, Key=key, Body=bytes(body))


def save_two(config: DCSConfig, committer: InlineCommitter) -> None:
    with Checkpointer("dev", config, celery_app=committer) as ckpt:
        ckpt.save(state(1), step=1).wait(timeout=120)
        ckpt.save(state(2), step=2).wait(timeout=120)


def test_a_restore_from_s3_into_device_targets_streams_objects_and_falls_back(
    dcs_config: DCSConfig, tmp_path: Path, aws_env: S3Bucket, inline: Inline
) -> None:
    config = s3_config(dcs_config, tmp_path, aws_env, file_shard_bytes=512 * 1024, incremental_saves=False)
    committer = inline(config)
    save_two(config, committer)
    into = {"w": torch.zeros(700, 500, dtype=torch.bfloat16), "m": torch.zeros(200_000)}
    copier = FakeCopier(into.values())
    restorer = DeviceRestorer(copier, 2, SLOT)
    with Checkpointer("dev", config, celery_app=committer, device_restorer=restorer) as ckpt:
        assert ckpt.restore(into=into).step == 2
        assert all(torch.equal(into[k], v) for k, v in state(2).items())
        assert copier.violations == [] and copier.unpinned == [] and copier.syncs == 1
        corrupt_newest(aws_env, "fleet/ckpt/dev/step-000000002/")
        with pytest.warns(RuntimeWarning, match="step 2 is corrupt"):
            assert ckpt.restore(into=into).step == 1
    assert all(torch.equal(into[k], v) for k, v in state(1).items())
    assert copier.violations == [] and copier.unpinned == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch.cuda.is_available() is False)")
def test_a_restore_from_s3_into_cuda_tensors_falls_back_past_a_corrupt_object(
    dcs_config: DCSConfig, tmp_path: Path, aws_env: S3Bucket, inline: Inline
) -> None:
    config = s3_config(dcs_config, tmp_path, aws_env, file_shard_bytes=512 * 1024, incremental_saves=False)
    committer = inline(config)
    save_two(config, committer)
    into = {"w": torch.zeros(700, 500, dtype=torch.bfloat16, device="cuda"), "m": torch.zeros(200_000, device="cuda")}
    with Checkpointer("dev", config, celery_app=committer, device_restorer=DeviceRestorer(None, 2, SLOT)) as ckpt:
        corrupt_newest(aws_env, "fleet/ckpt/dev/step-000000002/")
        with pytest.warns(RuntimeWarning, match="step 2 is corrupt"):
            assert ckpt.restore(into=into).step == 1
    assert all(torch.equal(into[k], v.cuda()) for k, v in state(1).items())
