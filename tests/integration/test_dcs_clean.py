"""`dcs clean`: what a stopped stack left in tmpfs and the temp dir goes, with a line per path and its bytes.

As a user meets it: a worker with the memory tier and metrics, a README-style trainer that saves a few steps
(older steps leave memory for the recycle pool) and is killed (kill -9: its staging buffers stay), a second
trainer that goes on running (its buffers are kept), then the
worker is killed too (its agent socket and Prometheus directory stay). `dcs clean` refuses while the worker runs,
lists with `--dry-run`, then removes the leftovers and keeps the committed memory steps. The host's own /dev/shm is
not touched: the test's runtime directory is a private one under it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dcs_tasks.config import DCSConfig
from tests.helpers.ports import free_port
from tests.helpers.preloaded import python_module
from tests.helpers.procs import REPO, WorkerProcess, child_env
from tests.helpers.shm import shm_dir
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.integration
MiB = 1024 * 1024

TRAINER = """
import time
import torch
from dcs_tasks import Checkpointer, DCSConfig

ckpt = Checkpointer("leftovers", DCSConfig())
model = torch.nn.Linear(512, 512)
for step in range(4):
    ckpt.save({"model": model.state_dict(), "step": step}, step=step).wait(60)
print("saved", flush=True)
time.sleep(120)
"""


def _clean(config: DCSConfig, tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = child_env(config, TMPDIR=str(tmp))
    command = [sys.executable, "-m", "dcs_tasks.cli.main", "clean", *args]
    return subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=120)


def _leftovers(runtime: Path, tmp: Path) -> dict[str, list[Path]]:
    return {
        "staging": sorted(runtime.rglob("*.stage")),
        "recycled": sorted((runtime / "memory" / ".recycle").glob("*")),
        "sockets": sorted(runtime.glob("agent-*.sock")),
        "metrics": sorted(tmp.glob("dcs-prometheus-*")),
    }


def test_dcs_clean_removes_what_a_killed_stack_left_and_says_how_much(dcs_config: DCSConfig, tmp_path: Path) -> None:
    runtime, tmp = shm_dir(tmp_path), tmp_path / "tmp"
    tmp.mkdir()
    runtime.mkdir(mode=0o700)
    config = dcs_config.model_copy(
        update={
            "runtime_dir": runtime,
            "staging_dir": runtime / "staging",
            "memory_dir": runtime / "memory",
            "memory_tier_bytes": 64 * MiB,
            "memory_keep_last": 1,
            "enable_metrics": True,
            "metrics_port": free_port(),
        }
    )
    # a fresh interpreter: `dcs clean` knows a running worker by its command line, which a forked one lacks
    worker = WorkerProcess(config, tmp_path / "worker.log", env={"TMPDIR": str(tmp)}, preloaded=False).start()
    # the trainers are forked from the forkserver that imported torch (tests/helpers/preloaded.py)
    trainer, running = (
        python_module(
            "tests.helpers.code_main",
            TRAINER.replace("leftovers", run),
            log=tmp_path / f"trainer-{run}.log",
            env=child_env(config),
        )
        for run in ("leftovers", "running")
    )
    try:
        for proc in (trainer, running):
            wait_until(lambda: "saved" in proc.output() or proc.poll() is not None, 120, "the trainer's 4 saves")  # noqa: B023
            assert proc.poll() is None and "saved" in proc.output().splitlines(), proc.output()
        trainer.send_signal(signal.SIGKILL)  # `running` goes on: its staging buffer is its own
        trainer.wait(30)
        live_buffers = sorted(runtime.rglob(f"*-running-{running.pid}-*.stage"))
        assert live_buffers
        busy = _clean(config, tmp)
        assert busy.returncode == 1 and "HostBusy" in busy.stderr, busy.stdout + busy.stderr
        assert worker.proc is not None and str(worker.proc.pid) in busy.stderr
        left = _leftovers(runtime, tmp)
        assert all(left.values()), left  # nothing removed while the worker runs
        worker.kill()  # kill -9: its socket and metrics directory stay too

        listed = _clean(config, tmp, "--dry-run")
        assert listed.returncode == 0, listed.stdout + listed.stderr
        assert _leftovers(runtime, tmp) == left  # a dry run removes nothing
        for path in (p for paths in left.values() for p in paths if p not in live_buffers):
            assert f"would remove {path}  " in listed.stdout, listed.stdout

        done = _clean(config, tmp)
        assert done.returncode == 0, done.stdout + done.stderr
        after = _leftovers(runtime, tmp)
        assert after["staging"] == live_buffers and f"its trainer, pid {running.pid}, is running" in done.stdout
        assert not after["recycled"] and not after["sockets"] and not after["metrics"], after
        assert list((runtime / "memory" / "leftovers").glob("step-*"))  # committed memory steps stay
        assert "kept" in done.stdout and "--memory-steps" in done.stdout
        total = re.search(r"dcs clean: removed (\d+) leftovers, (\d+) bytes", done.stdout)
        assert total is not None, done.stdout
        assert int(total.group(2)) >= 2 * MiB  # at least the staging buffer and a recycled step of a 1 MiB state
    finally:
        for proc in (trainer, running):
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(10)
        worker.discard()
