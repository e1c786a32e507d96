"""`async_io=False`: save() returns only once the step is committed."""

from __future__ import annotations

from pathlib import Path

import pytest

from dcs_tasks import Checkpointer
from dcs_tasks.config import DCSConfig
from tests.checkpoint_support import assert_same_state, ckpt_config, start_worker, training_state

pytestmark = pytest.mark.integration


def test_synchronous_save_is_committed_on_return(dcs_config: DCSConfig, tmp_path: Path) -> None:
    config = ckpt_config(dcs_config, tmp_path).model_copy(update={"async_io": False})
    worker = start_worker(config, tmp_path)
    state = training_state()
    try:
        with Checkpointer("sync", config) as ckpt:
            pending = ckpt.save(state, step=3)
            assert pending.done()
            assert [info.step for info in ckpt.list()] == [3]
            assert_same_state(state, ckpt.restore().state)
    finally:
        worker.discard()
