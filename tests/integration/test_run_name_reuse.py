"""A run name reused over another checkpoint root: the Redis ledger remembers step 0 as committed under the old
root, the new root holds nothing. As met: "step 0 ... already committed; save under a new step", with nothing
saying why or how to start fresh. Now `RunNameTaken` names the new directory, Redis as the one that remembers, and
the ways out (a new run name, another DCS_NAMESPACE, or the old root). Real workers, real Redis."""

from __future__ import annotations

from pathlib import Path

import pytest

from dcs_tasks import errors
from dcs_tasks.checkpoint import Checkpointer
from dcs_tasks.config import DCSConfig
from tests.checkpoint_support import ckpt_config, start_worker, training_state

pytestmark = pytest.mark.integration


def test_a_run_name_reused_in_a_new_checkpoint_dir_says_how_to_start_fresh(
    dcs_config: DCSConfig, tmp_path: Path
) -> None:
    old = ckpt_config(dcs_config, tmp_path, checkpoint_dir=tmp_path / "old-root")
    worker = start_worker(old, tmp_path, name="old-worker")
    try:
        with Checkpointer("exp1", old) as ckpt:
            ckpt.save(training_state(), step=0).wait(timeout=120)
    finally:
        worker.terminate()  # a warm stop withdraws its presence and settings (a kill -9's expire within 5 s)
    new = old.model_copy(update={"checkpoint_dir": tmp_path / "new-root"})  # `dcs up` again, another workdir
    worker = start_worker(new, tmp_path, name="new-worker")
    try:
        with Checkpointer("exp1", new) as ckpt:
            assert ckpt.list() == []  # nothing under the new root: the trainer starts again at step 0
            with pytest.raises(errors.CheckpointError) as caught:
                ckpt.save(training_state(), step=0)
            assert ckpt.list() == []
    finally:
        worker.terminate()
    message = str(caught.value)
    assert type(caught.value).__name__ == "RunNameTaken", repr(caught.value)
    assert "recorded as committed in Redis" in message and str(tmp_path / "new-root") in message, message
    assert "new name" in message and "DCS_NAMESPACE" in message, message
    # the new name works at once
    worker = start_worker(new, tmp_path, name="new-worker-2")
    try:
        with Checkpointer("exp2", new) as ckpt:
            ckpt.save(training_state(), step=0).wait(timeout=120)
            assert [info.step for info in ckpt.list()] == [0]
    finally:
        worker.discard()
