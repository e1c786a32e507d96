"""CUDA staging and restores: device tensors are staged through the pinned shared-memory buffer on a side stream
(plain and overlapped saves), and restored into CUDA tensors through the page-locked ring of
`dcs_tasks/checkpoint/restore/device.py` from files (a corrupt step falling back) and from the memory tier; the
S3 case is in tests/storage/test_checkpoint_s3_device.py.

Needs a GPU; skipped otherwise (the pipelines' logic runs on CPU in test_checkpoint_device_restore.py and
test_checkpoint_device_save.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dcs_tasks import Checkpointer
from dcs_tasks.config import DCSConfig
from tests.checkpoint_support import Inline, assert_same_state, ckpt_config, start_worker, training_state

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


def _cuda_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(1024, 513, generator=g).to(torch.bfloat16).cuda(),  # ~1 MiB: spans ring slots below
        "m": torch.randn(300_000, generator=g).cuda(),
        "t": torch.randn(64, 96, generator=g).cuda(),
    }


def _targets() -> dict[str, torch.Tensor]:
    return {
        "w": torch.zeros(1024, 513, dtype=torch.bfloat16, device="cuda"),
        "m": torch.zeros(300_000, device="cuda"),
        "t": torch.zeros(96, 64, device="cuda").t(),  # strided
    }


def _corrupt_largest(step_dir: Path) -> None:
    victim = max(step_dir.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0xFF
    victim.chmod(0o644)
    victim.write_bytes(bytes(data))


def test_restore_into_cuda_tensors_from_files_falls_back_past_a_corrupt_step(
    dcs_config: DCSConfig, tmp_path: Path, inline: Inline
) -> None:
    from dcs_tasks.checkpoint.restore.device import DeviceRestorer

    config = ckpt_config(dcs_config, tmp_path, file_shard_bytes=512 * 1024, incremental_saves=False)
    restorer = DeviceRestorer(slots=2, slot_bytes=256 * 1024)  # the CUDA runtime, small slots: reused many times
    with Checkpointer("gpu-files", config, celery_app=inline(config), device_restorer=restorer) as ckpt:
        ckpt.save(_cuda_state(1), step=1).wait(60)
        info = ckpt.save(_cuda_state(2), step=2).wait(60)
        into = _targets()
        assert ckpt.restore(step=2, into=into).step == 2
        assert all(torch.equal(into[k], v) for k, v in _cuda_state(2).items())
        _corrupt_largest(Path(info.path))
        with pytest.warns(RuntimeWarning, match="step 2 is corrupt"):
            restored = ckpt.restore(into=into)
    assert restored.step == 1 and all(t.is_cuda for t in into.values())
    assert all(torch.equal(into[k], v) for k, v in _cuda_state(1).items())


def test_restore_into_cuda_tensors_from_the_memory_tier(dcs_config: DCSConfig, tmp_path: Path, inline: Inline) -> None:
    from tests.helpers.shm import shm_dir

    config = ckpt_config(
        dcs_config,
        tmp_path,
        memory_tier_bytes=256 << 20,
        memory_dir=shm_dir(tmp_path) / "memory",
        storage_every_steps=1000,
        incremental_saves=False,
    )
    with Checkpointer("gpu-mem", config, celery_app=inline(config)) as ckpt:
        ckpt.save(_cuda_state(3), step=1, durable=False).wait(60)
    into = _targets()
    with Checkpointer("gpu-mem", config, celery_app=inline(config)) as fresh:
        restored = fresh.restore(into=into)
    assert restored.location == "memory"
    assert all(torch.equal(into[k], v) for k, v in _cuda_state(3).items())


def test_an_overlapped_cuda_save_with_the_guard_commits_the_state_at_the_call(
    dcs_config: DCSConfig, tmp_path: Path, inline: Inline
) -> None:
    config = ckpt_config(dcs_config, tmp_path)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 512)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    batch = torch.randn(256, 512, device="cuda")
    with Checkpointer("gpu-overlap", config, celery_app=inline(config)) as ckpt:
        assert ckpt.reserve({"model": model.state_dict()}).wait(60)
        ckpt.guard(optimizer)
        for step in range(1, 4):
            at_call = {k: v.detach().clone() for k, v in model.state_dict().items()}
            pending = ckpt.save({"model": model.state_dict()}, step=step, overlap=True)
            model(batch).square().mean().backward()  # forward and backward beside the copy
            optimizer.step()  # waits for the copies (the guard), then changes every weight
            optimizer.zero_grad()
            pending.wait(60)
            restored = ckpt.restore(step=step).state["model"]
            assert all(torch.equal(restored[k], at_call[k].cpu()) for k in at_call), step
