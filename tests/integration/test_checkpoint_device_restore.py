"""Restores into device tensors through the pipeline of `dcs_tasks/checkpoint/restore/device.py` (page-locked ring
slots, copies on a side stream, one synchronisation), run on CPU with the test runtime of `tests/helpers/
fakedevice.py`: copies run late, so a slot reused too early, a missing synchronisation or a pageable source shows
as wrong bytes or a recorded violation. Saves are persisted by the in-process committer, Redis real."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from dcs_tasks import Checkpointer
from dcs_tasks.checkpoint.restore.device import DeviceRestorer
from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import CheckpointNotFound
from tests.checkpoint_support import Inline, ckpt_config
from tests.helpers.fakedevice import FakeCopier
from tests.helpers.shm import shm_dir

pytestmark = pytest.mark.integration

SLOT = 64 * 1024  # small slots: every tensor spans several, every slot is reused many times


def state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "w": torch.randn(300, 257, generator=g).to(torch.bfloat16),  # ~150 KiB: spans slots
            "t": torch.randn(64, 96, generator=g),  # restored into a transposed (strided) target
            "b": torch.randn(7, generator=g),
            "empty": torch.zeros(0),
        },
        "opt": {"m": torch.randn(40_000, generator=g), "step": torch.tensor(seed)},
        "epoch": seed,
    }


def device_targets(like: dict[str, Any]) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """Zeroed targets of `like`'s shapes ("model/t" strided), and the tensors the fake runtime calls device ones (all
    but "model/b": a state mixing host and device targets)."""
    t = torch.zeros(96, 64).t()  # shape (64, 96), not contiguous
    into: dict[str, Any] = {
        "model": {
            "w": torch.zeros(300, 257, dtype=torch.bfloat16),
            "t": t,
            "b": torch.zeros(7),
            "empty": torch.zeros(0),
        },
        "opt": {"m": torch.zeros(40_000), "step": torch.tensor(0)},
        "epoch": 0,
    }
    on_device = [into["model"]["w"], t, into["opt"]["m"], into["opt"]["step"]]  # "model/b" stays a host target
    return into, on_device


def same(a: dict[str, Any], b: dict[str, Any]) -> None:
    for group in ("model", "opt"):
        for name, tensor in a[group].items():
            assert torch.equal(b[group][name], tensor), f"{group}/{name}"


def check_clean(copier: FakeCopier) -> None:
    assert copier.violations == [] and copier.unpinned == []
    assert copier.copies > 0


def test_a_restore_into_device_targets_goes_through_page_locked_slots_in_order(
    dcs_config: DCSConfig, tmp_path: Path, inline: Inline
) -> None:
    config = ckpt_config(dcs_config, tmp_path, file_shard_bytes=128 * 1024)
    saved = state(1)
    into, on_device = device_targets(saved)
    copier = FakeCopier(on_device)
    with Checkpointer("dev", config, celery_app=inline(config), device_restorer=DeviceRestorer(copier, 2, SLOT)) as c:
        c.save(saved, step=1).wait(timeout=30)
        restored = c.restore(into=into)
    assert restored.step == 1
    same(saved, into)
    assert restored.state["model"]["w"] is into["model"]["w"]  # the targets themselves
    check_clean(copier)
    assert copier.syncs == 1  # one synchronisation for the whole restore, none per tensor
    assert copier.event_waits >= 1  # slots were reused, each only after its copies ran


def test_a_restore_with_the_page_cache_dropped_reads_the_files_again_bit_exact(
    dcs_config: DCSConfig, tmp_path: Path, inline: Inline
) -> None:
    config = ckpt_config(dcs_config, tmp_path, file_shard_bytes=128 * 1024)
    saved = state(4)
    into, on_device = device_targets(saved)
    copier = FakeCopier(on_device)
    with Checkpointer("cold", config, celery_app=inline(config), device_restorer=DeviceRestorer(copier, 3, SLOT)) as c:
        info = c.save(saved, step=1).wait(timeout=30)
        for f in Path(info.path).glob("*.safetensors"):  # O_DIRECT where the file system takes it
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        c.restore(into=into)
    same(saved, into)
    check_clean(copier)


def test_a_corrupt_newest_step_falls_back_and_the_targets_hold_the_older_one(
    dcs_config: DCSConfig, tmp_path: Path, inline: Inline
) -> None:
    config = ckpt_config(dcs_config, tmp_path, file_shard_bytes=128 * 1024, incremental_saves=False)
    into, on_device = device_targets(state(1))
    copier = FakeCopier(on_device)
    with Checkpointer("fb", config, celery_app=inline(config), device_restorer=DeviceRestorer(copier, 2, SLOT)) as c:
        c.save(state(1), step=1).wait(timeout=30)
        info = c.save(state(2), step=2).wait(timeout=30)
        victim = max(Path(info.path).glob("*.safetensors"), key=lambda p: p.stat().st_size)
        data = bytearray(victim.read_bytes())
        data[-5] ^= 0xFF
        victim.chmod(0o644)
        victim.write_bytes(bytes(data))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            restored = c.restore(into=into)
        assert restored.step == 1
        assert any("step 2 is corrupt" in str(w.message) for w in caught)
        same(state(1), into)
        check_clean(copier)
        with pytest.raises(CheckpointNotFound):  # neither step verifies: the error, not a silent partial state
            for step_dir in (Path(info.path).parent / "step-000000001",):
                for f in step_dir.glob("*.safetensors"):
                    f.chmod(0o644)
                    raw = bytearray(f.read_bytes())
                    raw[-1] ^= 0xFF
                    f.write_bytes(bytes(raw))
            c.restore(into=into)


def test_strict_false_and_sharded_restores_into_device_targets_take_the_same_path(
    dcs_config: DCSConfig, tmp_path: Path, inline: Inline
) -> None:
    config = ckpt_config(dcs_config, tmp_path)
    committer = inline(config)
    full = torch.randn(10, 6)
    parts = torch.tensor_split(full, 2, 0)
    savers = [Checkpointer("sh", config, rank=r, world_size=2, celery_app=committer) for r in range(2)]
    try:
        for pending in [
            s.save({"w": parts[s.rank].clone(), "r": torch.full((3,), 1.0 + s.rank)}, 5, sharding={"w": 0})
            for s in savers
        ]:
            pending.wait(timeout=30)
    finally:
        for s in savers:
            s.close()
    # RESHARD: two ranks' parts joined for one trainer, into device targets
    into = {"w": torch.zeros(10, 6), "r": torch.zeros(3)}
    copier = FakeCopier(into.values())
    with Checkpointer("sh", config, celery_app=committer, device_restorer=DeviceRestorer(copier, 2, 128)) as c:
        c.restore(into=into)
    assert torch.equal(into["w"], full) and torch.equal(into["r"], torch.full((3,), 1.0))
    check_clean(copier)
    assert copier.syncs == 1
    # RANGES (strict=False): only the tensors the target holds, a strided device target among them
    part = {"w": torch.zeros(6, 10).t()}
    copier = FakeCopier(part.values())
    with Checkpointer("sh", config, celery_app=committer, device_restorer=DeviceRestorer(copier, 2, 128)) as c:
        restored = c.restore(into=part, strict=False)
    assert restored.state is part and torch.equal(part["w"], full)
    check_clean(copier)


def memory_config(base: DCSConfig, tmp_path: Path) -> DCSConfig:
    return ckpt_config(
        base,
        tmp_path,
        memory_tier_bytes=64 << 20,
        memory_dir=shm_dir(tmp_path) / "memory",
        storage_every_steps=1000,
        file_shard_bytes=128 * 1024,
        incremental_saves=False,
    )


@pytest.mark.parametrize("refuse", [False, True], ids=["registered-in-place", "registration-refused"])
def test_a_memory_tier_step_is_copied_from_its_registered_mappings(
    dcs_config: DCSConfig, tmp_path: Path, inline: Inline, refuse: bool
) -> None:
    config = memory_config(dcs_config, tmp_path)
    saved = state(3)
    into, on_device = device_targets(saved)
    copier = FakeCopier(on_device, refuse_pinning=refuse)
    restorer = DeviceRestorer(copier, 2, SLOT)
    with Checkpointer("mem", config, celery_app=inline(config)) as c:
        c.save(saved, step=1, durable=False).wait(timeout=30)
    with Checkpointer("mem", config, celery_app=inline(config), device_restorer=restorer) as fresh:
        restored = fresh.restore(into=into)
    assert restored.step == 1
    same(saved, into)
    check_clean(copier)
    registered = [size for op, _, size in copier.pinner.calls if op == "register"]
    memory_files = sorted(p.stat().st_size for p in (Path(config.host.memory_dir) / "mem").rglob("*.safetensors"))
    assert sorted(registered) == memory_files  # every file's mapping offered in place, whole
    if not refuse:
        assert copier.pinner.registered == {}  # and unregistered once the copies ran
