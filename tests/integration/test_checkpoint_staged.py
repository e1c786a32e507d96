"""`Checkpointer.stage()` then `commit_staged()`: the state at `stage()` is what commits, with no second copy; the
staged copy is consumed once (committed or released) and its buffer is free again afterwards. Real Redis, the
in-process committer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dcs_tasks import Checkpointer
from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import CheckpointError
from tests.checkpoint_support import Inline, ckpt_config

pytestmark = pytest.mark.integration


@pytest.fixture
def config(dcs_config: DCSConfig, tmp_path: Path) -> DCSConfig:
    return ckpt_config(dcs_config, tmp_path, staging_buffers=1)  # one buffer: a leaked lease would block the next save


@pytest.fixture
def ckpt(config: DCSConfig, inline: Inline) -> Iterator[Checkpointer]:
    with Checkpointer("staged", config, celery_app=inline(config)) as made:
        yield made


def in_buffer(ckpt: Checkpointer, t: torch.Tensor) -> bool:
    for buf in ckpt.staging_buffers:
        if buf.view is not None and buf.view.data_ptr() <= t.data_ptr() < buf.view.data_ptr() + buf.capacity:
            return True
    return False


def test_what_commits_is_the_state_at_stage_and_the_views_are_the_staged_copy(ckpt: Checkpointer) -> None:
    state = {"w": torch.arange(1024.0), "b": torch.ones(3, 5, dtype=torch.bfloat16), "tied": None, "n": 7}
    state["tied"] = state["w"]
    at_stage = {"w": state["w"].clone(), "b": state["b"].clone()}
    staged = ckpt.stage(state)
    assert staged is not None and staged.stall_seconds > 0
    assert set(staged.views) == {"w", "b"}  # the tied tensor is staged once
    assert all(in_buffer(ckpt, v) for v in staged.views.values())
    assert torch.equal(staged.views["w"], at_stage["w"])

    state["w"].add_(1.0)  # the trainer moves on before the step exists
    state["b"].zero_()
    pending = ckpt.commit_staged(staged, 3, metadata={"note": "staged"})
    pending.wait(timeout=60)

    restored = ckpt.restore()
    assert restored.step == 3 and restored.metadata["note"] == "staged"
    assert torch.equal(restored.state["w"], at_stage["w"]) and torch.equal(restored.state["b"], at_stage["b"])
    assert restored.state["tied"] is restored.state["w"] and restored.state["n"] == 7
    assert pending.stall_seconds >= staged.stall_seconds
    ckpt.save({"w": torch.zeros(4)}, 4).wait(timeout=60)  # the only buffer came back


def test_a_staged_copy_is_consumed_once(config: DCSConfig, ckpt: Checkpointer, inline: Inline) -> None:
    staged = ckpt.stage({"w": torch.ones(8)})
    assert staged is not None
    with Checkpointer("other", config, celery_app=inline(config)) as other:
        with pytest.raises(CheckpointError, match="another Checkpointer"):
            other.commit_staged(staged, 1)
    ckpt.commit_staged(staged, 1).wait(timeout=60)
    with pytest.raises(CheckpointError, match="already committed or released"):
        ckpt.commit_staged(staged, 2)
    assert staged.release() is False

    released = ckpt.stage({"w": torch.full((8,), 2.0)})
    assert released is not None and released.release() is True
    assert [info.step for info in ckpt.list()] == [1]

    again = ckpt.stage({"w": torch.full((8,), 3.0)})  # the buffer is free after a release
    assert again is not None
    with pytest.raises(CheckpointError):  # step 1 is committed: the commit fails and gives the buffer back
        ckpt.commit_staged(again, 1)
    ckpt.save({"w": torch.full((8,), 4.0)}, 2).wait(timeout=60)
    assert torch.equal(ckpt.restore(1).state["w"], torch.ones(8))
    assert torch.equal(ckpt.restore(2).state["w"], torch.full((8,), 4.0))
