"""Save and restore: bit-exact through a real `dcs worker`; in place, and a step committed on disk never saved
again, through an in-process committer (the same persist and commit, no worker process)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis
import torch
from safetensors import safe_open

from dcs_tasks import Checkpointer
from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import CheckpointError, StateMismatch
from dcs_tasks.keys import Keys
from tests.checkpoint_support import Inline, assert_same_state, ckpt_config, start_worker, training_state

pytestmark = pytest.mark.integration


def test_round_trip_bit_exact_and_files_open_with_safetensors(dcs_config: DCSConfig, tmp_path: Path) -> None:
    config = ckpt_config(dcs_config, tmp_path, file_shard_bytes=1 << 20)
    worker = start_worker(config, tmp_path)
    state = training_state(width=512)  # ~2 MiB: several files, written by both worker processes
    try:
        with Checkpointer("exp1", config) as ckpt:
            pending = ckpt.save(state, step=100, metadata={"lr": 3e-4})
            assert pending.stall_seconds > 0
            info = pending.wait(timeout=60)
            assert info.step == 100 and info.files >= 2
            assert [i.step for i in ckpt.list()] == [100]
            restored = ckpt.restore()
            assert restored.step == 100 and restored.metadata == {"lr": 3e-4}
            assert_same_state(state, restored.state)
    finally:
        worker.terminate()
    step_dir = Path(info.path)
    manifest = json.loads((step_dir / "manifest.json").read_text())
    assert manifest["run"] == "exp1" and manifest["step"] == 100 and manifest["format_version"] == 1
    assert (step_dir.parent / "latest").read_text().strip() == "step-000000100"
    names = sorted(p.name for p in step_dir.glob("*.safetensors"))
    assert names == sorted(f["name"] for f in manifest["files"])
    with safe_open(str(step_dir / names[0]), framework="pt") as f:
        assert len(list(f.keys())) > 0


def test_restore_into_existing_tensors_in_place(dcs_config: DCSConfig, tmp_path: Path, inline: Inline) -> None:
    config = ckpt_config(dcs_config, tmp_path)
    saved = training_state(seed=1)
    target = training_state(seed=2)
    weight = target["model"]["0.weight"]
    with Checkpointer("exp2", config, celery_app=inline(config)) as ckpt:
        ckpt.save(saved, step=5).wait(timeout=60)
        restored = ckpt.restore(into=target)
        assert restored.state["model"]["0.weight"] is weight  # the caller's tensor, filled in place
        assert torch.equal(weight, saved["model"]["0.weight"])
        assert_same_state(saved, restored.state)
        wrong = training_state(width=32)
        with pytest.raises(StateMismatch, match=r"model/0\.weight"):
            ckpt.restore(into=wrong)


def test_a_step_committed_on_disk_is_never_saved_again_even_when_the_ledger_forgot_it(
    dcs_config: DCSConfig, tmp_path: Path, inline: Inline
) -> None:
    """The ledger's record of a committed step expires (7 days) or goes with Redis's data; the step's directory
    still holds its manifest. Saving that step again is refused before anything is staged or sent."""
    config = ckpt_config(dcs_config, tmp_path)
    with Checkpointer("kept", config, celery_app=inline(config)) as ckpt:
        info = ckpt.save(training_state(seed=1), step=5).wait(timeout=60)
        files = {p.name: p.read_bytes() for p in Path(info.path).iterdir()}
        redis.Redis.from_url(config.redis.url).delete(Keys(config.redis.namespace).ckpt_state("kept", 5))
        with pytest.raises(CheckpointError, match="already committed"):
            ckpt.save(training_state(seed=2), step=5)
        assert {p.name: p.read_bytes() for p in Path(info.path).iterdir()} == files
        assert_same_state(training_state(seed=1), ckpt.restore(5).state)
