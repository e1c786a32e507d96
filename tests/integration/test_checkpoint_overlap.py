"""`save(overlap=True)`: the copy into staging runs beside the next forward/backward; what commits is the state
at the call, as long as the caller waits (`wait_staged`, or `guard(optimizer)` before each optimizer step)
before changing it; a failed copy fails that save only; a step already committed still raises at the call."""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from dcs_tasks import Checkpointer
from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import CheckpointError, CheckpointFailed
from tests.checkpoint_support import Inline, assert_same_state, ckpt_config, training_state

pytestmark = pytest.mark.integration


def test_an_overlapped_save_commits_the_state_at_the_call_once_the_copy_is_waited_for(
    dcs_config: DCSConfig, tmp_path: Path, inline: Inline
) -> None:
    config = ckpt_config(dcs_config, tmp_path, file_shard_bytes=1 << 20)
    committer = inline(config)
    state = training_state(width=512)
    expected = copy.deepcopy(state)
    try:
        with Checkpointer("overlap", config, celery_app=committer) as ckpt:
            pending = ckpt.save(state, step=1, overlap=True)
            pending.wait_staged(timeout=60)
            assert pending.staged
            for tensor in state["model"].values():
                tensor.add_(1.0)  # the caller moves on: the saved step keeps the values at the call
            pending.wait(timeout=60)
            assert_same_state(ckpt.restore(step=1).state, expected)
            with pytest.raises(CheckpointError, match="already"):
                ckpt.save(state, step=1, overlap=True)  # checked before save returns, as without overlap
    finally:
        committer.close()


@pytest.mark.parametrize("guarded", [True, False])
def test_guard_makes_each_optimizer_step_wait_for_the_overlapped_copy(
    dcs_config: DCSConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, guarded: bool, inline: Inline
) -> None:
    """The copy is slowed (0.2 s before it starts) so that an optimizer step that does not wait overtakes it:
    unguarded, a saved step holds later weights (the case the guard exists for); guarded, every step is exact."""
    config = ckpt_config(dcs_config, tmp_path, staging_buffers=3)
    committer = inline(config)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(32, 256), torch.randn(32, 256)
    snapshots: dict[int, dict[str, Any]] = {}
    try:
        with Checkpointer("guarded", config, celery_app=committer) as ckpt:
            real = ckpt._stage

            def slow_stage(*args: Any) -> None:
                time.sleep(0.2)
                real(*args)

            monkeypatch.setattr(ckpt, "_stage", slow_stage)
            handle = ckpt.guard(opt) if guarded else None
            for step in range(1, 7):
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()  # waits for the previous step's copy before changing the weights
                state = {"model": model.state_dict(), "optim": opt.state_dict()}
                snapshots[step] = copy.deepcopy(state)
                ckpt.save(state, step=step, overlap=True)
            ckpt.wait_staged(timeout=60)
            if handle is not None:
                handle.remove()
            for pending in ckpt._pending:
                pending.wait(timeout=60)
            exact = []
            for step, expected in snapshots.items():
                restored = ckpt.restore(step=step).state["model"]
                exact.append(all(torch.equal(restored[k], v) for k, v in expected["model"].items()))
            assert all(exact) if guarded else not all(exact), exact
    finally:
        committer.close()


def test_a_failed_overlapped_copy_fails_that_save_only(
    dcs_config: DCSConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, inline: Inline
) -> None:
    config = ckpt_config(dcs_config, tmp_path)
    committer = inline(config)
    state = training_state(seed=4)
    try:
        with Checkpointer("failing", config, celery_app=committer) as ckpt:
            real = ckpt._stage
            calls = {"n": 0}

            def stage_once_broken(*args: Any) -> None:  # a fault in the copy (e.g. a device error)
                calls["n"] += 1
                if calls["n"] == 1:
                    raise RuntimeError("injected copy fault")
                real(*args)

            monkeypatch.setattr(ckpt, "_stage", stage_once_broken)
            broken = ckpt.save(state, step=1, overlap=True)
            broken.wait_staged(timeout=60)
            with pytest.raises(CheckpointFailed, match="injected copy fault"):
                broken.wait(timeout=60)
            ckpt.save(state, step=2, overlap=True).wait(timeout=60)  # the buffer came back; the next save works
            restored = ckpt.restore()
            assert restored.step == 2
            assert_same_state(restored.state, state)
            assert [info.step for info in ckpt.list()] == [2]
    finally:
        committer.close()
