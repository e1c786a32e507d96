"""Saves persisted and committed in the trainer's own process (`InlineCommitter`), Redis real, no worker: the
save path's fast tests, on files and on S3-free paths alike."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from dcs_tasks import Checkpointer
from dcs_tasks.checkpoint.inline import InlineCommitter
from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import CheckpointFailed, ConfigError
from tests.checkpoint_support import assert_same_state, ckpt_config, training_state

pytestmark = pytest.mark.integration


def test_an_inline_committer_saves_commits_and_restores_without_a_worker(dcs_config: DCSConfig, tmp_path: Path) -> None:
    config = ckpt_config(dcs_config, tmp_path, file_shard_bytes=1 << 20, keep_last=2)
    inline = InlineCommitter(config)
    state = training_state(width=512)
    try:
        with Checkpointer("inline", config, celery_app=inline) as ckpt:
            began = time.monotonic()
            infos = [ckpt.save(state, step=s).wait(timeout=30) for s in (1, 2, 3)]
            assert time.monotonic() - began < 20
            assert infos[0].files >= 2
            inline.drain(timeout=30)  # retention after the last commit
            assert [i.step for i in ckpt.list()] == [2, 3]
            assert_same_state(state, ckpt.restore().state)
    finally:
        inline.close()
    step_dir = Path(infos[-1].path)
    manifest = json.loads((step_dir / "manifest.json").read_text())
    assert {f.get("source_step") for f in manifest["files"]} <= {None, 1, 2}  # incremental references
    assert (step_dir.parent / "latest").read_text().strip() == "step-000000003"


def test_an_inline_persist_that_fails_fails_the_save_with_the_reason(dcs_config: DCSConfig, tmp_path: Path) -> None:
    root = tmp_path / "ro"
    root.mkdir()
    config = ckpt_config(dcs_config, tmp_path, checkpoint_dir=root / "ckpt")
    (root / "ckpt").write_text("a file where the root should be a directory")
    inline = InlineCommitter(config)
    try:
        with Checkpointer("broken", config, celery_app=inline) as ckpt:
            with pytest.raises(CheckpointFailed, match="persisting model-00001"):
                ckpt.save({"w": torch.ones(10)}, step=1).wait(timeout=30)
            assert ckpt.list() == []
    finally:
        inline.close()


def test_an_inline_committer_refuses_replicas(dcs_config: DCSConfig, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="replica_dir"):
        InlineCommitter(ckpt_config(dcs_config, tmp_path, replica_dir=tmp_path / "replica"))
