"""`async_io=False`: save() returns only once the step is committed."""

from __future__ import annotations

from pathlib import Path

import pytest

from dcs_tasks import Checkpointer
from dcs_tasks.config import DCSConfig
from tests.checkpoint_support import Inline, assert_same_state, ckpt_config, training_state

pytestmark = pytest.mark.integration


def test_synchronous_save_is_committed_on_return(dcs_config: DCSConfig, tmp_path: Path, inline: Inline) -> None:
    config = ckpt_config(dcs_config, tmp_path).model_copy(update={"async_io": False})
    committer = inline(config)
    state = training_state()
    try:
        with Checkpointer("sync", config, celery_app=committer) as ckpt:
            pending = ckpt.save(state, step=3)
            assert pending.done()
            assert [info.step for info in ckpt.list()] == [3]
            assert_same_state(state, ckpt.restore().state)
    finally:
        committer.close()
