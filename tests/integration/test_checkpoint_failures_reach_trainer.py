"""A save that fails on the worker reaches the trainer: the README's own trainer, against a real `dcs worker`, ends
with an error naming the step and the worker's reason instead of exiting as if it had saved. The setups are the
ones users met: the trainer's checkpoint directory differs from the worker's, a run directory that leaves the
worker's root, the memory tier's directory full. Also: `save_failure_policy=warn`, `close()`'s answer, a failure
`pending.wait()` already raised is not raised again."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from dcs_tasks import Checkpointer
from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import CheckpointFailed, ConfigError
from tests.checkpoint_support import Inline, ckpt_config, mounted_tmpfs, start_worker, training_state, wait_until
from tests.helpers.procs import WorkerProcess, child_env
from tests.integration.readme_trainer import (
    checkpoint_dir_files,
    failures_counted,
    readme_trainer_script,
    run_readme_trainer,
    trainer_env,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture
def workers() -> Iterator[list[WorkerProcess]]:
    started: list[WorkerProcess] = []
    yield started
    for w in started:
        w.discard()


def test_the_readme_trainer_fails_naming_the_cause_when_its_checkpoint_dir_differs_from_the_workers(
    dcs_config: DCSConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: list[WorkerProcess]
) -> None:
    """`dcs up` started the worker with one DCS_CHECKPOINT_DIR, the trainer's shell exports another: the worker
    refuses every step (UntrustedPath). The trainer used to exit 0 with nothing saved; now it ends with an error
    that names the cause (at construction when the worker published its settings, else at the next save)."""
    worker_config = ckpt_config(dcs_config, tmp_path, checkpoint_dir=tmp_path / "worker-ckpt")
    workers.append(start_worker(worker_config, tmp_path))
    trainer_config = worker_config.model_copy(update={"checkpoint_dir": tmp_path / "trainer-ckpt"})
    trainer_env(monkeypatch, trainer_config)
    run = run_readme_trainer(steps=250)
    assert run.raised is not None, f"the trainer ended as if it had saved (close() returned {run.closed!r})"
    assert isinstance(run.raised, CheckpointFailed | ConfigError), repr(run.raised)
    message = str(run.raised)
    assert "UntrustedPath" in message or "checkpoint" in message.lower(), message
    assert checkpoint_dir_files(tmp_path / "trainer-ckpt") == []


def test_a_run_directory_leaving_the_workers_root_fails_the_readme_trainer_at_its_next_save(
    dcs_config: DCSConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: list[WorkerProcess]
) -> None:
    """Same settings on both sides, but the run's directory is a symlink out of the checkpoint root: the worker
    refuses step 0 (UntrustedPath). The README trainer's next save raises SaveFailed naming step 0 and the
    worker's reason, within a second of that save; nothing is written."""
    config = ckpt_config(dcs_config, tmp_path, checkpoint_dir=tmp_path / "ckpt")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "ckpt").mkdir(parents=True)
    ((tmp_path / "ckpt") / "exp1").symlink_to(tmp_path / "elsewhere")
    workers.append(start_worker(config, tmp_path))
    trainer_env(monkeypatch, config)
    run = run_readme_trainer(steps=250)
    assert isinstance(run.raised, CheckpointFailed), f"ended by {run.raised!r}, close() returned {run.closed!r}"
    assert type(run.raised).__name__ == "SaveFailed", repr(run.raised)
    assert getattr(run.raised, "step", None) == 0, str(run.raised)
    assert getattr(run.raised, "error_type", None) == "UntrustedPath", str(run.raised)
    assert "step 0 of run 'exp1'" in str(run.raised) and "UntrustedPath" in str(run.raised)
    assert run.steps_trained == 101  # raised by the next save (step 100's), before it staged anything
    learned = run.seconds_after_save(0)
    print(f"UntrustedPath of step 0 raised by the next save, {learned:.2f} s after save(step=0) returned")
    assert learned < 5.0
    assert checkpoint_dir_files(tmp_path / "elsewhere") == []


def test_the_readme_trainer_run_as_a_script_exits_non_zero_naming_the_failed_step(
    dcs_config: DCSConfig, tmp_path: Path, workers: list[WorkerProcess]
) -> None:
    """`python trainer.py` with the README's lines, as the user ran it, while the worker refuses the run's steps
    (its directory leaves the worker's root): the process used to print "trainer finished" and exit 0 with nothing
    saved; now it exits 1 with SaveFailed naming step 0 and UntrustedPath on stderr."""
    config = ckpt_config(dcs_config, tmp_path, checkpoint_dir=tmp_path / "ckpt")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "ckpt").mkdir(parents=True)
    ((tmp_path / "ckpt") / "exp1").symlink_to(tmp_path / "elsewhere")
    workers.append(start_worker(config, tmp_path))
    script = readme_trainer_script(tmp_path / "trainer.py")
    env = child_env(config, DCS_ENABLE_METRICS="false")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "trainer finished" not in done.stdout, (done.returncode, done.stdout)
    assert "SaveFailed" in done.stderr and "step 0 of run 'exp1'" in done.stderr, done.stderr[-3000:]
    assert "UntrustedPath" in done.stderr, done.stderr[-3000:]


@pytest.fixture
def full_memory_dir(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs for the memory tier (private, as the worker requires), unmounted afterwards."""
    with mounted_tmpfs(tmp_path) as mount_point:
        yield mount_point


def fill(directory: Path) -> None:
    """Fill `directory`'s file system to the last byte, as other users of /dev/shm do."""
    with (directory / "other-users-file").open("wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * (1 << 20))
        except OSError:
            pass


def test_the_readme_trainer_fails_naming_no_space_when_the_memory_dir_is_full(
    dcs_config: DCSConfig,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    workers: list[WorkerProcess],
    full_memory_dir: Path,
) -> None:
    """The memory tier is on for both, its directory is full (others' files): the worker cannot write step 0
    (No space left on device). The README trainer used to exit 0 with nothing restorable; now its next save or
    its close() raises SaveFailed naming step 0 and the reason."""
    config = ckpt_config(
        dcs_config, tmp_path, memory_tier_bytes=8 * 1024 * 1024, memory_dir=full_memory_dir, storage_every_steps=1000
    )
    workers.append(start_worker(config, tmp_path))
    fill(full_memory_dir)
    trainer_env(monkeypatch, config)
    run = run_readme_trainer(steps=250)
    assert isinstance(run.raised, CheckpointFailed), f"ended by {run.raised!r}, close() returned {run.closed!r}"
    assert getattr(run.raised, "step", None) == 0, str(run.raised)
    assert "No space left on device" in str(run.raised), str(run.raised)
    print(f"ENOSPC of step 0 raised after {run.steps_trained} steps, {run.seconds_after_save(0):.2f} s after the save")


def test_policy_warn_logs_and_counts_and_close_lists_the_failed_steps_apart_from_unfinished_ones(
    dcs_config: DCSConfig,
    tmp_path: Path,
    inline: Inline,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`save_failure_policy=warn` (persisted by an in-process committer): a step the worker's code refuses is logged
    (naming step and reason) and counted, never raised; training saves on; close() returns no unfinished step and
    lists the failed one with its reason."""
    from dcs_tasks.config import SaveFailurePolicy

    config = ckpt_config(
        dcs_config, tmp_path, checkpoint_dir=tmp_path / "ckpt", save_failure_policy=SaveFailurePolicy.WARN
    )
    (tmp_path / "ckpt").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    ((tmp_path / "ckpt") / "bad").symlink_to(tmp_path / "elsewhere")
    committer = inline(config)
    before = failures_counted("failed")
    state = training_state()
    with Checkpointer("bad", config, celery_app=committer) as ckpt:
        first = ckpt.save(state, step=1)
        wait_until(first.done, 30, "step 1 to fail")
        ckpt.save(state, step=2)  # no raise under warn
        closed = ckpt.close()
    assert closed == () and closed.unfinished == () and closed.failed == (1, 2) and not closed.ok
    assert all(f.error_type == "UntrustedPath" for f in closed.failures), closed.failures
    assert failures_counted("failed") - before == 2
    assert any(
        "step 1 of run 'bad' failed" in r.getMessage() and "UntrustedPath" in r.getMessage() for r in caplog.records
    )


def test_a_failure_wait_already_raised_is_not_raised_again_and_close_raises_one_not_seen(
    dcs_config: DCSConfig, tmp_path: Path, inline: Inline
) -> None:
    """Policy raise (persisted by an in-process committer): a trainer that waited on the failed save (and got
    CheckpointFailed) is not told again by the next save; a failure it never looked at is raised by close(), once
    everything is closed."""
    config = ckpt_config(dcs_config, tmp_path, checkpoint_dir=tmp_path / "ckpt")
    (tmp_path / "ckpt").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    ((tmp_path / "ckpt") / "bad").symlink_to(tmp_path / "elsewhere")
    state = training_state()
    ckpt = Checkpointer("bad", config, celery_app=inline(config))
    with pytest.raises(CheckpointFailed, match="UntrustedPath"):
        ckpt.save(state, step=1).wait(30)
    unseen = ckpt.save(state, step=2)  # step 1's failure was raised by wait(): not again here
    wait_until(unseen.done, 30, "step 2 to fail")
    with pytest.raises(CheckpointFailed, match="step 2 of run 'bad'") as raised:
        ckpt.close()
    assert getattr(raised.value, "steps", None) == (2,)
    closed = ckpt.close()  # closed: the same answer, not raised again
    assert closed.failed == (1, 2) and closed.unfinished == ()
