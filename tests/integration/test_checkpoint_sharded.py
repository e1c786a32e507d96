"""Multi-rank checkpoints (persisted by an in-process committer, the worker's code): a step counts only once every
rank committed it, and restore reshards dim-split tensors to another world size (rank-local tensors follow their
rank)."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from dcs_tasks import Checkpointer
from dcs_tasks.checkpoint.inline import InlineCommitter
from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import CheckpointError, CheckpointNotFound, StateMismatch
from tests.checkpoint_support import Inline, ckpt_config
from tests.helpers.preloaded import run_module
from tests.helpers.procs import child_env

pytestmark = pytest.mark.integration

SAVED_WORLD = 4
ROWS, COLS = 10, 6  # 10 rows over 4 ranks: uneven shards (3, 3, 2, 2)


def global_state(step: int) -> dict[str, torch.Tensor]:
    """The unsharded tensors the ranks' parts come from."""
    g = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(ROWS, COLS, generator=g),  # split along dim 0
        "col": torch.randn(3, 2 * SAVED_WORLD + 1, generator=g).to(torch.bfloat16),  # split along dim 1
    }


def rank_state(step: int, rank: int, world: int) -> dict[str, Any]:
    full = global_state(step)
    return {
        "model": {
            "w": torch.tensor_split(full["w"], world, 0)[rank].clone(),
            "col": torch.tensor_split(full["col"], world, 1)[rank].clone(),
        },
        "rng": torch.full((4,), float(rank * 100 + step)),  # rank-local
        "step": step,
    }


SHARDING = {"model/w": 0, "model/col": 1}


def dcs_ckpt(config: DCSConfig, *args: str) -> str:
    argv = ("ckpt", *args, "--dir", str(config.checkpoint.dir))
    workdir = Path(config.checkpoint.dir).parent / "cli-output"
    done = run_module("dcs_tasks.cli.main", *argv, workdir=workdir, env=child_env(config), timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def save_all(committer: InlineCommitter, run: str, step: int, ranks: range) -> None:
    """Ranks `ranks` save `step`, persisted and committed by `committer` (the worker's code, in this process)."""
    config = committer.config
    checkpointers = [Checkpointer(run, config, rank=r, world_size=SAVED_WORLD, celery_app=committer) for r in ranks]
    try:
        pendings = [c.save(rank_state(step, c.rank, SAVED_WORLD), step, sharding=SHARDING) for c in checkpointers]
        for pending in pendings:
            pending.wait(timeout=60)
    finally:
        for c in checkpointers:
            c.close()


@pytest.fixture
def config(dcs_config: DCSConfig, tmp_path: Path) -> DCSConfig:
    return ckpt_config(dcs_config, tmp_path)


@pytest.fixture
def committer(config: DCSConfig, inline: Inline) -> InlineCommitter:
    return inline(config)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 6])
def test_restore_reshards_to_any_world_size(config: DCSConfig, committer: InlineCommitter, world: int) -> None:
    save_all(committer, "shard", 10, range(SAVED_WORLD))
    full = global_state(10)
    for rank in range(world):
        with Checkpointer("shard", config, rank=rank, world_size=world) as ckpt:
            restored = ckpt.restore()
        assert restored.step == 10 and restored.state["step"] == 10
        model = restored.state["model"]
        assert torch.equal(model["w"], torch.tensor_split(full["w"], world, 0)[rank])
        assert model["col"].dtype == torch.bfloat16
        assert torch.equal(model["col"], torch.tensor_split(full["col"], world, 1)[rank])
        local = rank if rank < SAVED_WORLD else 0
        assert torch.equal(restored.state["rng"], torch.full((4,), float(local * 100 + 10)))


def test_a_step_counts_only_once_every_rank_committed_it(config: DCSConfig, committer: InlineCommitter) -> None:
    save_all(committer, "atomic", 10, range(SAVED_WORLD))
    save_all(committer, "atomic", 20, range(SAVED_WORLD - 1))  # rank 3 died before saving step 20
    with Checkpointer("atomic", config, rank=0, world_size=2) as ckpt:
        assert ckpt.restore().step == 10
        with pytest.raises(CheckpointNotFound, match=r"only ranks \[0, 1, 2\] committed it"):
            ckpt.restore(step=20)
    listing = dcs_ckpt(config, "list", "--run", "atomic")
    assert re.search(r"^\s+10 .* 4 ranks$", listing, re.M), listing
    assert re.search(r"^\s+20  incomplete: only ranks \[0, 1, 2\]", listing, re.M), listing
    rank3 = dcs_ckpt(config, "list", "--run", "atomic", "--rank", "3")
    assert [line.split()[0] for line in rank3.splitlines()] == ["10"], rank3
    save_all(committer, "atomic", 20, range(SAVED_WORLD - 1, SAVED_WORLD))  # the restarted rank 3 catches up
    with Checkpointer("atomic", config, rank=1, world_size=2) as ckpt:
        restored = ckpt.restore()
    assert restored.step == 20
    assert torch.equal(restored.state["model"]["w"], torch.tensor_split(global_state(20)["w"], 2, 0)[1])


def test_a_corrupt_shard_falls_back_to_the_previous_complete_step(
    config: DCSConfig, committer: InlineCommitter
) -> None:
    save_all(committer, "corrupt", 10, range(SAVED_WORLD))
    save_all(committer, "corrupt", 20, range(SAVED_WORLD))
    shard = next((Path(config.checkpoint.dir) / "corrupt" / "rank-00002" / "step-000000020").glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with Checkpointer("corrupt", config, rank=0, world_size=1) as ckpt, warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        restored = ckpt.restore()  # world 1 reads every rank, the corrupt one included
    assert restored.step == 10 and any("step 20 is corrupt" in str(w.message) for w in seen)
    assert torch.equal(restored.state["model"]["w"], global_state(10)["w"])


def test_restore_into_existing_tensors_after_resharding(config: DCSConfig, committer: InlineCommitter) -> None:
    save_all(committer, "into", 10, range(SAVED_WORLD))
    target = rank_state(0, 1, 2)  # rank 1 of 2: the shapes its part of step 10 has
    weight = target["model"]["w"]
    with Checkpointer("into", config, rank=1, world_size=2) as ckpt:
        restored = ckpt.restore(into=target)
        assert restored.state["model"]["w"] is weight
        assert torch.equal(weight, torch.tensor_split(global_state(10)["w"], 2, 0)[1])
        with pytest.raises(StateMismatch, match="model/w"):
            ckpt.restore(into=rank_state(0, 0, 4))  # rank 0 of 4's shapes


def test_bad_sharding_or_rank_is_refused_with_the_name(config: DCSConfig, committer: InlineCommitter) -> None:
    with Checkpointer("bad", config, rank=0, world_size=2, celery_app=committer) as ckpt:
        with pytest.raises(CheckpointError, match="model/nope"):
            ckpt.save(rank_state(1, 0, 2), 1, sharding={"model/nope": 0})
        with pytest.raises(CheckpointError, match=r"model/w.*dim 2"):
            ckpt.save(rank_state(1, 0, 2), 1, sharding={"model/w": 2})
    with pytest.raises(CheckpointError, match="rank 2 is not a rank of world size 2"):
        Checkpointer("bad", config, rank=2, world_size=2)


def test_a_single_trainer_checkpoint_reshards_too(config: DCSConfig, committer: InlineCommitter) -> None:
    """Train on one process, resume on two: the plain layout reads as a complete 1-rank run."""
    with Checkpointer("solo", config, celery_app=committer) as ckpt:
        ckpt.save(rank_state(10, 0, 1), 10, sharding=SHARDING).wait(timeout=60)
    assert (Path(config.checkpoint.dir) / "solo" / "step-000000010" / "manifest.json").is_file()
    for rank in range(2):
        with Checkpointer("solo", config, rank=rank, world_size=2) as ckpt:
            restored = ckpt.restore()
        assert torch.equal(restored.state["model"]["w"], torch.tensor_split(global_state(10)["w"], 2, 0)[rank])
        assert torch.equal(restored.state["rng"], torch.full((4,), 10.0))  # rank-local: from the only rank


def test_retention_never_deletes_the_newest_step_every_rank_committed(
    config: DCSConfig, committer: InlineCommitter
) -> None:
    from dcs_tasks.checkpoint.store.ledger.retention import apply_retention
    from dcs_tasks.checkpoint.store.payloads import RetentionPolicy

    save_all(committer, "keep", 10, range(SAVED_WORLD))
    save_all(committer, "keep", 20, range(SAVED_WORLD - 1))  # rank 3 is behind
    rank0 = Path(config.checkpoint.dir) / "keep" / "rank-00000"
    keep_last_1 = RetentionPolicy(keep_last=1)
    assert apply_retention(rank0, keep_last_1, set()) == []  # step 10 is the only restorable step
    with Checkpointer("keep", config, rank=0, world_size=2) as ckpt:
        assert ckpt.restore().step == 10
    save_all(committer, "keep", 20, range(SAVED_WORLD - 1, SAVED_WORLD))
    assert apply_retention(rank0, keep_last_1, set()) == [10]  # now step 20 is complete
    with Checkpointer("keep", config, rank=0, world_size=2) as ckpt:
        assert ckpt.restore().step == 20
