"""Settings a trainer and its host's worker both read are checked where they are read: a real `dcs worker`
publishes what it uses, and a `Checkpointer` whose settings differ refuses at construction with
`SettingsMismatch`, naming the setting, both values and the process to change. `dcs doctor`, run as a user
would from the trainer's environment, reports the same and exits 1.

As a user met it: after `dcs up`, exporting `DCS_MEMORY_TIER_BYTES` (or another `DCS_CHECKPOINT_DIR`) in the
trainer's shell made every save fail on the worker while the trainer exited 0; the other way round the trainer
silently had no memory tier."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from dcs_tasks import errors
from dcs_tasks.checkpoint import Checkpointer
from dcs_tasks.config import DCSConfig
from tests.checkpoint_support import ckpt_config, start_worker, training_state
from tests.helpers.procs import REPO, WorkerProcess

pytestmark = pytest.mark.integration

MiB = 1024 * 1024


@pytest.fixture
def workers() -> Iterator[list[WorkerProcess]]:
    started: list[WorkerProcess] = []
    yield started
    for worker in started:
        worker.discard()


def refused(config: DCSConfig) -> str:
    """The message of the SettingsMismatch a Checkpointer with `config` raises at construction."""
    with pytest.raises(errors.ConfigError) as caught:
        Checkpointer("exp1", config).close()
    assert type(caught.value).__name__ == "SettingsMismatch", repr(caught.value)
    return str(caught.value)


@pytest.fixture
def mem(tmp_path: Path) -> Iterator[Path]:
    """A private memory-tier directory in /dev/shm (tmpfs), removed afterwards."""
    path = Path("/dev/shm") / f"dcs-test-{os.getpid()}-{tmp_path.name}-mem"
    path.mkdir(mode=0o700)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_trainer_with_another_checkpoint_dir_than_the_workers_is_refused_at_construction(
    dcs_config: DCSConfig, tmp_path: Path, workers: list[WorkerProcess]
) -> None:
    config = ckpt_config(dcs_config, tmp_path, checkpoint_dir=tmp_path / "worker-ckpt")
    workers.append(start_worker(config, tmp_path))
    message = refused(config.model_copy(update={"checkpoint_dir": tmp_path / "trainer-ckpt"}))
    assert "checkpoint_dir" in message and str(tmp_path / "worker-ckpt") in message, message
    assert str(tmp_path / "trainer-ckpt") in message and "DCS_CHECKPOINT_DIR=" in message, message
    assert "restart the worker" in message and "trainer's environment" in message, message
    assert not (tmp_path / "trainer-ckpt").exists()


def test_a_memory_tier_set_only_in_the_trainers_shell_is_refused_naming_the_worker_to_change(
    dcs_config: DCSConfig, tmp_path: Path, workers: list[WorkerProcess], mem: Path
) -> None:
    config = ckpt_config(dcs_config, tmp_path)
    workers.append(start_worker(config, tmp_path))
    trainer = config.model_copy(update={"memory_tier_bytes": 64 * MiB, "memory_dir": mem, "storage_every_steps": 4})
    message = refused(trainer)
    assert "DCS_MEMORY_TIER_BYTES=67108864" in message and "the worker runs without one" in message, message
    assert "start the worker with" in message and "before `dcs up`" in message, message


def test_a_worker_memory_tier_the_trainer_lacks_is_refused_naming_the_trainer_settings_to_set(
    dcs_config: DCSConfig, tmp_path: Path, workers: list[WorkerProcess], mem: Path
) -> None:
    config = ckpt_config(dcs_config, tmp_path, memory_tier_bytes=64 * MiB, memory_dir=mem)
    workers.append(start_worker(config, tmp_path))
    message = refused(config.model_copy(update={"memory_tier_bytes": 0}))
    assert f"DCS_MEMORY_TIER_BYTES={64 * MiB}" in message and f"DCS_MEMORY_DIR={mem}" in message, message
    assert "trainer has none" in message, message


def test_agreeing_settings_construct_and_save_and_doctor_says_so(
    dcs_config: DCSConfig, tmp_path: Path, workers: list[WorkerProcess], mem: Path
) -> None:
    config = ckpt_config(dcs_config, tmp_path, memory_tier_bytes=64 * MiB, memory_dir=mem)
    workers.append(start_worker(config, tmp_path))
    with Checkpointer("exp1", config) as ckpt:
        ckpt.save(training_state(), step=1).wait(timeout=120)
    done = doctor(config)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ok    settings agree" in done.stdout and "ok    worker serves this host" in done.stdout, done.stdout


def doctor(config: DCSConfig, **env: str) -> subprocess.CompletedProcess[str]:
    """`dcs doctor` in a process of its own with the trainer's environment (`config`, plus `env`)."""
    full = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(REPO), **config.to_env(), **env}
    argv = [sys.executable, "-m", "dcs_tasks.cli.main", "doctor"]
    return subprocess.run(argv, env=full, capture_output=True, text=True, timeout=120, cwd=REPO)


def test_doctor_names_each_disagreement_and_the_fix_and_exits_1(
    dcs_config: DCSConfig, tmp_path: Path, workers: list[WorkerProcess]
) -> None:
    config = ckpt_config(dcs_config, tmp_path)
    workers.append(start_worker(config, tmp_path))
    trainer = config.model_copy(update={"checkpoint_dir": tmp_path / "other", "memory_tier_bytes": 8 * MiB})
    done = doctor(trainer)
    assert done.returncode == 1, done.stdout + done.stderr
    out = done.stdout
    assert "FAIL  settings agree" in out and "checkpoint_dir: this trainer uses" in out, out
    assert "memory tier: this trainer has DCS_MEMORY_TIER_BYTES" in out, out
    assert "ok    redis reachable" in out, out
    assert not any(secret in out for secret in config.secret_values()), out
    print(out)


def test_doctor_without_a_worker_or_redis_says_what_to_start(dcs_config: DCSConfig, tmp_path: Path) -> None:
    config = ckpt_config(dcs_config, tmp_path)
    done = doctor(config)
    assert done.returncode == 1 and "FAIL  worker serves this host" in done.stdout, done.stdout
    assert "start `dcs worker`" in done.stdout, done.stdout
    gone = doctor(config, DCS_REDIS_URL="redis://:hunter22@127.0.0.1:1/0")
    assert gone.returncode == 1 and "FAIL  redis reachable: redis://:***@127.0.0.1:1/0" in gone.stdout, gone.stdout
    assert "hunter22" not in gone.stdout + gone.stderr


def test_a_worker_started_after_the_checkpointer_is_checked_at_the_first_save(
    dcs_config: DCSConfig, tmp_path: Path, workers: list[WorkerProcess]
) -> None:
    """The trainer started first (nothing to compare with yet); the worker `dcs up` then started has another root:
    the first save raises SettingsMismatch before anything is staged, instead of failing on the worker."""
    config = ckpt_config(dcs_config, tmp_path, checkpoint_dir=tmp_path / "trainer-ckpt")
    with Checkpointer("exp1", config) as ckpt:
        workers.append(start_worker(config.model_copy(update={"checkpoint_dir": tmp_path / "worker-ckpt"}), tmp_path))
        with pytest.raises(errors.ConfigError, match="checkpoint_dir: this trainer uses") as caught:
            ckpt.save(training_state(), step=0)
        assert type(caught.value).__name__ == "SettingsMismatch"
    assert not (tmp_path / "trainer-ckpt" / "exp1").exists()
