"""torch DCP through DCS into S3 (`DCS_CHECKPOINT_DIR=s3://bucket/prefix`, a real S3 server): `dcp.save` with
`DCSStorageWriter` uploads a committed step (objects, manifest, `latest`), `dcp.load` with `DCSStorageReader` reads
it back bit-exact, and `dcs ckpt export --format dcp` writes it out as a directory DCP's own reader loads."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from dcs_tasks import Checkpointer
from dcs_tasks.config import DCSConfig
from dcs_tasks.integrations.dcp import DCSStorageReader, DCSStorageWriter
from tests.checkpoint_support import Inline
from tests.helpers.preloaded import run_module
from tests.helpers.procs import child_env
from tests.storage.conftest import S3Bucket
from tests.storage.s3_support import MiB, objects, s3_config

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def test_dcp_save_and_load_through_s3(dcs_config: DCSConfig, tmp_path: Path, aws_env: S3Bucket, inline: Inline) -> None:
    config = s3_config(dcs_config, tmp_path, aws_env, file_shard_bytes=4 * MiB)
    torch.manual_seed(0)
    state = {"model": {"w": torch.randn(1500, 1024), "b": torch.randn(7).to(torch.bfloat16)}, "meta": {"step": 12}}
    with Checkpointer("dcp-s3", config, celery_app=inline(config)) as ckpt:
        dcp.save(state, storage_writer=DCSStorageWriter(ckpt, step=12))
        assert [info.step for info in ckpt.list()] == [12]
    keys = objects(aws_env)
    assert any(k.endswith("dcp-s3/step-000000012/manifest.json") for k in keys), keys
    assert any(k.endswith("dcp-s3/latest") for k in keys), keys

    into = {"model": {"w": torch.zeros(1500, 1024), "b": torch.zeros(7, dtype=torch.bfloat16)}, "meta": {"step": 0}}
    dcp.load(into, storage_reader=DCSStorageReader("dcp-s3", config=config))
    assert torch.equal(into["model"]["w"], state["model"]["w"]) and torch.equal(into["model"]["b"], state["model"]["b"])
    assert into["meta"] == {"step": 12}

    out = tmp_path / "exported"
    argv = ("ckpt", "export", "--run", "dcp-s3", "--format", "dcp", "--out", str(out))
    done = run_module("dcs_tasks.cli.main", *argv, workdir=tmp_path / "cli", env=child_env(config), timeout=120)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stdout + done.stderr
    back = {"model": {"w": torch.zeros(1500, 1024), "b": torch.zeros(7, dtype=torch.bfloat16)}, "meta": {"step": 0}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        dcp.load(back, storage_reader=FileSystemReader(str(out)))
    assert torch.equal(back["model"]["w"], state["model"]["w"]) and back["meta"] == {"step": 12}
