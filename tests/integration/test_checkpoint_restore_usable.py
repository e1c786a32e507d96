"""Restored tensors are ordinary tensors a trainer can hand to any torch API."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dcs_tasks import Checkpointer
from dcs_tasks.config import DCSConfig
from tests.checkpoint_support import Inline, ckpt_config, training_state

pytestmark = pytest.mark.integration


def test_restored_rng_state_and_optimizer_load_back(dcs_config: DCSConfig, tmp_path: Path, inline: Inline) -> None:
    config = ckpt_config(dcs_config, tmp_path)
    committer = inline(config)
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "rng": torch.get_rng_state()}
    state["extra"] = training_state()["extra"]  # mixed dtypes around the tensors under test
    torch.set_rng_state(state["rng"])
    expected_draw = torch.rand(8)  # what the RNG gives after the saved state
    try:
        with Checkpointer("usable", config, celery_app=committer) as ckpt:
            ckpt.save(state, step=1).wait(timeout=60)
            restored = ckpt.restore().state
    finally:
        committer.close()
    for tensor in (restored["rng"], *restored["model"].values()):
        assert tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == tensor.nbytes
    torch.set_rng_state(restored["rng"])  # torch reads the storage from its start: a view would break this
    assert torch.equal(torch.rand(8), expected_draw)
    fresh = torch.optim.Adam(torch.nn.Linear(16, 16).parameters())
    fresh.load_state_dict(restored["optim"])
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
