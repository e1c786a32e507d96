"""Shared pieces of the checkpoint tests: a realistic training state and config/worker builders."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from dcs_tasks.checkpoint.inline import InlineCommitter
from dcs_tasks.config import DCSConfig
from tests.helpers.preloaded import run_module
from tests.helpers.procs import WorkerProcess, child_env
from tests.helpers.shm import shm_dir
from tests.helpers.waiting import wait_until as wait_until  # re-exported for the checkpoint tests

Inline = Callable[[DCSConfig], InlineCommitter]  # the `inline` fixture (tests/conftest.py): a committer per config


def training_state(seed: int = 0, width: int = 64) -> dict[str, Any]:
    """What trainers save: model + optimizer state (int keys), a step counter and the RNG state; mixed dtypes."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    model(torch.randn(4, width)).sum().backward()
    opt.step()
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "step": 7,
        "rng": torch.get_rng_state(),
        "extra": {
            "bf16": torch.randn(33, 3).to(torch.bfloat16),
            "fp16_view": torch.randn(8, 6).to(torch.float16).t(),
            "mask": torch.rand(17) > 0.5,
            "ids": torch.arange(10, dtype=torch.int64)[::2],
            "lr": 3e-4,
            "name": "exp",
        },
    }


def assert_same_state(a: Any, b: Any, path: str = "") -> None:
    """Equal in structure, types, dtypes and bits."""
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(
            a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
        ), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            assert_same_state(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_state(x, y, f"{path}/{i}")
    else:
        assert a == b, path


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def ckpt_config(base: DCSConfig, tmp_path: Path, **overrides: Any) -> DCSConfig:
    """The test config with fast retries and a private staging directory."""
    values: dict[str, Any] = {
        "staging_dir": shm_dir(tmp_path),
        "retry_delay_seconds": 0.05,
        "retry_backoff_max_seconds": 0.2,
        "max_retries": 2,
    }
    values.update(overrides)
    return base.model_copy(update=values)


def start_worker(config: DCSConfig, tmp_path: Path, name: str = "worker", concurrency: int = 2) -> WorkerProcess:
    return WorkerProcess(config, tmp_path / f"{name}.log", concurrency=concurrency).start()


def dcs_ckpt(config: DCSConfig, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """`dcs ckpt ARGS --dir <checkpoint_dir>` as a user runs it (a process of its own with the user's environment,
    forked from the preloaded forkserver); it never ends in a traceback."""
    workdir = Path(config.checkpoint.dir).parent / "dcs-ckpt-output"
    argv = ("ckpt", *args, "--dir", str(config.checkpoint.dir))
    done = run_module("dcs_tasks.cli.main", *argv, workdir=workdir, env=child_env(config), timeout=timeout)
    assert "Traceback" not in done.stdout + done.stderr, done.stdout + done.stderr
    return done


@contextlib.contextmanager
def mounted_tmpfs(tmp_path: Path, size: str = "16m") -> Iterator[Path]:
    """A private tmpfs of `size` at `<tmp_path>/memory` (mode 0700, as the worker requires of a memory dir),
    unmounted afterwards; the test is skipped where it cannot be mounted (not root)."""
    mount_point = tmp_path / "memory"
    mount_point.mkdir(mode=0o700)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(mount_point)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a {size} tmpfs (needs root): {done.stderr.decode().strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)
