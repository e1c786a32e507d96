"""A trainer that never reaches `close()` leaves no staging file behind (dcs_tasks/checkpoint/exiting.py).

The trainer is the README's loop in its own process against a real `dcs worker`: it saves, waits for the step,
and then ends as trainers do end, by an uncaught exception or by SIGTERM (a scheduler's stop). Staging buffers
live in tmpfs, so a file left there holds its memory until someone deletes it.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dcs_tasks.config import DCSConfig
from tests.checkpoint_support import ckpt_config, start_worker
from tests.helpers.procs import REPO, child_env

pytestmark = pytest.mark.integration

TRAINER = """
import sys, time
import torch
from dcs_tasks import Checkpointer, DCSConfig

ckpt = Checkpointer("exits", DCSConfig())
model = torch.nn.Linear(512, 512)
for step in range(3):
    ckpt.save({"model": model.state_dict(), "step": step}, step=step).wait(60)
print("saved", flush=True)
if sys.argv[1] == "raise":
    raise RuntimeError("the loss went to nan")
time.sleep(120)
"""


def _staging_files(config: DCSConfig) -> list[Path]:
    return sorted(Path(config.host.staging_dir).glob("*.stage"))  # set by ckpt_config


def _trainer(config: DCSConfig, how: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", TRAINER, how],
        env=child_env(config),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_a_trainer_that_dies_by_an_exception_leaves_no_staging_file(dcs_config: DCSConfig, tmp_path: Path) -> None:
    config = ckpt_config(dcs_config, tmp_path)
    worker = start_worker(config, tmp_path)
    try:
        trainer = _trainer(config, "raise")
        out, err = trainer.communicate(timeout=120)
        assert trainer.returncode == 1 and "the loss went to nan" in err, out + err
        assert "saved" in out
        assert _staging_files(config) == []
    finally:
        worker.discard()


def test_a_trainer_stopped_by_sigterm_leaves_no_staging_file(dcs_config: DCSConfig, tmp_path: Path) -> None:
    config = ckpt_config(dcs_config, tmp_path)
    worker = start_worker(config, tmp_path)
    try:
        trainer = _trainer(config, "sleep")
        assert trainer.stdout is not None
        assert trainer.stdout.readline().strip() == "saved"
        assert _staging_files(config) != []  # the buffers are there while it trains
        trainer.send_signal(signal.SIGTERM)
        trainer.communicate(timeout=60)
        assert trainer.returncode == -signal.SIGTERM  # still ended by SIGTERM, as before
        assert _staging_files(config) == []
    finally:
        worker.discard()
