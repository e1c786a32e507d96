"""CUDA staging: device tensors are staged through the pinned shared-memory buffer on a side stream.

Needs a GPU; skipped otherwise (the CPU path is covered by the other checkpoint tests).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dcs_tasks import Checkpointer
from dcs_tasks.config import DCSConfig
from tests.checkpoint_support import assert_same_state, ckpt_config, start_worker, training_state

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.integration,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch.cuda.is_available() is False)"),
]


def test_cuda_state_round_trip_and_weights_may_change_after_save(dcs_config: DCSConfig, tmp_path: Path) -> None:
    config = ckpt_config(dcs_config, tmp_path)
    worker = start_worker(config, tmp_path)
    cpu_state = training_state(width=256)
    state = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in cpu_state["model"].items()}
    expected = {k: v.clone() for k, v in state.items()}
    try:
        with Checkpointer("gpu", config) as ckpt:
            pending = ckpt.save(state, step=1)
            for tensor in state.values():  # the documented wait point: save() returned, weights may change
                tensor.add_(1.0)
            pending.wait(60)
            (buf,) = [b for b in ckpt.staging_buffers if b.capacity]
            assert buf.pinned  # cudaHostRegister'ed (once per mapping), unregistered at close
            ckpt.save(state, step=2).wait(60)  # the same pinned buffer again
            assert buf.pinned
            restored = ckpt.restore(step=1)
            assert_same_state({k: v.cpu() for k, v in expected.items()}, restored.state)
            into = {k: torch.zeros_like(v) for k, v in state.items()}
            ckpt.restore(step=1, into=into)
            assert all(t.is_cuda for t in into.values())
            assert all(torch.equal(into[k], expected[k]) for k in state)
    finally:
        worker.discard()
