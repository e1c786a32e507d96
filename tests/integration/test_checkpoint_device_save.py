"""Saves of device states through `dcs_tasks/checkpoint/save/cuda.py`, run on CPU with the test runtime of
`tests/helpers/fakedevice.py` (queued copies run only when waited for, or fail when told to): an overlapped save
returns with its copies still queued, `guard(optimizer)` makes the step wait for them, and what commits is the state
at the call; a copy that fails fails that save only; `reserve()` registers the staging buffers so no save does.
Persisted by the in-process committer, Redis real."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from dcs_tasks import Checkpointer
from dcs_tasks.checkpoint.save.cuda import DeviceStager
from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import CheckpointFailed
from tests.checkpoint_support import Inline, ckpt_config
from tests.helpers.fakedevice import FakeCopier

pytestmark = pytest.mark.integration


def model_and_copier(**fake: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer, FakeCopier]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 16))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    return model, optimizer, FakeCopier(model.parameters(), **fake)


def test_an_overlapped_save_commits_the_state_at_the_call_while_training_goes_on(
    dcs_config: DCSConfig, tmp_path: Path, inline: Inline
) -> None:
    config = ckpt_config(dcs_config, tmp_path)
    model, optimizer, copier = model_and_copier()
    stager = DeviceStager(copier.pinner, copier)
    with Checkpointer("ov", config, celery_app=inline(config), device_stager=stager) as ckpt:
        ckpt.guard(optimizer)
        at_call = {k: v.clone() for k, v in model.state_dict().items()}
        copier.hold()  # the copies stay in flight until released
        pending = ckpt.save({"model": model.state_dict()}, step=1, overlap=True)
        assert not pending.staged and copier.pending() == len(at_call)  # save returned, copies only queued
        model(torch.randn(32, 64)).square().mean().backward()  # forward and backward beside the copy
        releaser = threading.Timer(0.3, copier.release)
        releaser.start()
        optimizer.step()  # the guard waits for the copies first
        releaser.join()
        assert pending.staged
        pending.wait(timeout=30)
        assert any(not torch.equal(at_call[k], v) for k, v in model.state_dict().items())  # training went on
        restored = ckpt.restore(step=1).state["model"]
    assert set(restored) == set(at_call)
    assert all(torch.equal(restored[k], at_call[k]) for k in at_call)
    # the staging buffer was page-locked for the copies, and unlocked when the checkpointer closed
    assert [op for op, _, _ in copier.pinner.calls] == ["register", "unregister"]


def test_a_device_copy_that_fails_fails_only_that_save(dcs_config: DCSConfig, tmp_path: Path, inline: Inline) -> None:
    config = ckpt_config(dcs_config, tmp_path)
    model, _, copier = model_and_copier(fail_copies=True)
    stager = DeviceStager(copier.pinner, copier)
    with Checkpointer("fail", config, celery_app=inline(config), device_stager=stager) as ckpt:
        pending = ckpt.save({"model": model.state_dict()}, step=1, overlap=True)
        with pytest.raises(CheckpointFailed, match=r"copying step 1 into staging failed.*illegal memory access"):
            pending.wait(timeout=30)
        copier.fail_copies = False
        ckpt.save({"model": model.state_dict()}, step=2, overlap=True).wait(timeout=30)
        assert [i.step for i in ckpt.list()] == [2]
        restored = ckpt.restore().state["model"]
    assert all(torch.equal(restored[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("background", [False, True])
def test_reserve_registers_the_staging_buffers_so_the_first_save_does_not(
    dcs_config: DCSConfig, tmp_path: Path, inline: Inline, background: bool
) -> None:
    config = ckpt_config(dcs_config, tmp_path)
    model, _, copier = model_and_copier()
    stager = DeviceStager(copier.pinner, copier)
    state = {"model": model.state_dict()}
    with Checkpointer("res", config, celery_app=inline(config), device_stager=stager) as ckpt:
        reservation = ckpt.reserve(state, background=background)
        assert reservation.wait(30)
        assert reservation.pinned and reservation.pin_seconds is not None and reservation.seconds > 0
        registered = [c for c in copier.pinner.calls if c[0] == "register"]
        assert len(registered) == len([b for b in ckpt.staging_buffers if b.capacity]) >= 1
        pending = ckpt.save(state, step=1)
        assert pending.staged  # without overlap: staged before save returns
        pending.wait(timeout=30)
        assert [c for c in copier.pinner.calls if c[0] == "register"] == registered  # the save registered nothing
        restored = ckpt.restore(step=1).state["model"]
    assert all(torch.equal(restored[k], v) for k, v in model.state_dict().items())
