"""`restore(into=part, strict=False)` of steps saved by an in-process committer (the worker's persist and
commit): a target holding only some of the checkpoint's tensors (e.g. just the model) is filled, the rest of the
checkpoint is ignored; the default, `strict=True`, still refuses a target that does not hold exactly the
checkpoint's tensors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from dcs_tasks import Checkpointer
from dcs_tasks.checkpoint.inline import InlineCommitter
from dcs_tasks.checkpoint.restore import boxread, sharded
from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import StateMismatch
from tests.checkpoint_support import Inline, as_bytes, ckpt_config, training_state

pytestmark = pytest.mark.integration


@pytest.fixture
def config(dcs_config: DCSConfig, tmp_path: Path) -> DCSConfig:
    return ckpt_config(dcs_config, tmp_path)


@pytest.fixture
def committer(config: DCSConfig, inline: Inline) -> InlineCommitter:
    """The worker's persist and commit, in this process."""
    return inline(config)


def zeros_like_model(state: dict[str, Any]) -> dict[str, Any]:
    return {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}


def test_a_model_only_target_is_filled_from_a_full_checkpoint(config: DCSConfig, committer: InlineCommitter) -> None:
    saved = training_state(seed=3)
    with Checkpointer("partial", config, celery_app=committer) as ckpt:
        ckpt.save(saved, 5).wait(timeout=60)
        target = zeros_like_model(saved)
        weight = target["model"]["0.weight"]
        with pytest.raises(StateMismatch, match="no counterpart in the target state"):
            ckpt.restore(into=target)  # strict by default: the optimizer state etc. are missing
        assert not weight.any()  # refused before anything was written
        restored = ckpt.restore(into=target, strict=False)
    assert restored.step == 5 and restored.state is target and target["model"]["0.weight"] is weight
    for name, tensor in saved["model"].items():
        assert torch.equal(as_bytes(target["model"][name]), as_bytes(tensor)), name


def test_strict_false_still_refuses_what_the_checkpoint_lacks_or_shapes_that_differ(
    config: DCSConfig, committer: InlineCommitter
) -> None:
    saved = training_state(seed=4)
    with Checkpointer("refuse", config, celery_app=committer) as ckpt:
        ckpt.save(saved, 1).wait(timeout=60)
        unknown = zeros_like_model(saved)
        unknown["model"]["nope"] = torch.zeros(3)
        with pytest.raises(StateMismatch, match="no tensor 'model/nope'"):
            ckpt.restore(into=unknown, strict=False)
        wrong = zeros_like_model(saved)
        wrong["model"]["2.bias"] = torch.zeros(9)
        with pytest.raises(StateMismatch, match=r"model/2\.bias"):
            ckpt.restore(into=wrong, strict=False)
        assert not any(t.any() for t in wrong["model"].values())  # checked before anything was read


def test_a_partial_target_after_resharding(config: DCSConfig, committer: InlineCommitter) -> None:
    """A `sharding=` run saved by 2 ranks, read by rank 1 of 3 into a target holding only the weight."""
    full = torch.randn(10, 4, generator=torch.Generator().manual_seed(1))
    saving = [Checkpointer("split", config, rank=r, world_size=2, celery_app=committer) for r in range(2)]
    try:
        for ckpt in saving:
            state = {"model": {"w": torch.tensor_split(full, 2)[ckpt.rank].clone()}, "rng": torch.ones(2)}
            ckpt.save(state, 7, sharding={"model/w": 0}).wait(timeout=60)
    finally:
        for ckpt in saving:
            ckpt.close()
    target = {"model": {"w": torch.zeros(3, 4)}}  # rank 1 of 3: rows 4..6
    with Checkpointer("split", config, rank=1, world_size=3, celery_app=committer) as ckpt:
        assert ckpt.restore(into=target, strict=False).state is target
    assert torch.equal(target["model"]["w"], torch.tensor_split(full, 3)[1])
    step = sharded.complete_steps(Path(config.checkpoint.dir) / "split")[7]
    assert torch.equal(boxread.read_flat(step)["model/w"], full)  # as one trainer sees it (export)
