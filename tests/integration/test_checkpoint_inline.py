"""Saves persisted and committed in the trainer's own process (`InlineCommitter`), Redis real, no worker: the
save path's fast tests, and what follows a commit (retention, replicas, the memory tier's flush) run on its
threads."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from dcs_tasks import Checkpointer
from dcs_tasks.checkpoint.inline import InlineCommitter
from dcs_tasks.checkpoint.restore.reader import step_dirs
from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import CheckpointFailed
from tests.checkpoint_support import assert_same_state, ckpt_config, training_state
from tests.helpers.shm import shm_dir

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


def test_an_inline_committer_replicates_and_prunes_the_replica(dcs_config: DCSConfig, tmp_path: Path) -> None:
    """Replicas are the library's (`dcs_tasks.checkpoint.replicating`): an inline committer copies each committed
    step to `replica_dir`, moves the replica's `latest`, and applies retention there, as a worker does."""
    config = ckpt_config(dcs_config, tmp_path, replica_dir=tmp_path / "replica", keep_last=2)
    inline = InlineCommitter(config)
    state = training_state(width=256)
    try:
        with Checkpointer("copied", config, celery_app=inline) as ckpt:
            for step in (1, 2, 3):
                ckpt.save(state, step=step).wait(timeout=30)
                inline.drain(timeout=60)  # retention and the replica copy after the commit
            replica_run = tmp_path / "replica" / "copied"
            assert [s for s, _ in step_dirs(replica_run)] == [2, 3]
            assert (replica_run / "latest").read_text().strip() == "step-000000003"
            shutil.rmtree(Path(config.checkpoint.dir) / "copied" / "step-000000003")
            restored = ckpt.restore()
            assert (restored.step, restored.location) == (3, "replica")
            assert_same_state(state, restored.state)
    finally:
        inline.close()


def test_an_inline_committer_keeps_steps_in_memory_flushes_every_nth_and_replicates_it(
    dcs_config: DCSConfig, tmp_path: Path
) -> None:
    """The memory tier without a worker: each step commits in `memory_dir`, every 2nd is flushed to storage
    (`dcs_tasks.checkpoint.tiering.flush`) and the flushed step is replicated, as a worker's flush task does."""
    config = ckpt_config(
        dcs_config,
        tmp_path,
        memory_tier_bytes=64 << 20,
        memory_dir=shm_dir(tmp_path) / "memory",
        memory_keep_last=2,
        storage_every_steps=2,
        replica_dir=tmp_path / "replica",
    )
    inline = InlineCommitter(config)
    states = {s: training_state(seed=s, width=128) for s in (1, 2, 3)}
    try:
        with Checkpointer("tiered", config, celery_app=inline) as ckpt:
            for step, state in states.items():
                info = ckpt.save(state, step=step).wait(timeout=30)
                assert info.path == Path(config.host.memory_dir) / "tiered" / f"step-{step:09d}"
            inline.drain(timeout=60)  # the flush of step 2 and its replica
            assert [s for s, _ in step_dirs(Path(config.checkpoint.dir) / "tiered")] == [2]
            assert [s for s, _ in step_dirs(tmp_path / "replica" / "tiered")] == [2]
            restored = ckpt.restore()
            assert (restored.step, restored.location) == (3, "memory")
            assert_same_state(states[3], restored.state)
    finally:
        inline.close()
