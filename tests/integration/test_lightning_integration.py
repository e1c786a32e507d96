"""`DCSCheckpointIO` (dcs_tasks/integrations/lightning.py) under Lightning's own `Trainer`, on the CPU: a run killed
with SIGKILL mid-training resumes with `ckpt_path="last"` from the newest committed step and trains on with the
losses of an uninterrupted run; `ModelCheckpoint`'s top-k removals take its markers away while DCS retention
prunes the steps (against a real `dcs worker`); a checkpoint holding an object is refused naming its key, with
nothing saved; a file that is not a DCS marker is refused on load."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

from dcs_tasks.checkpoint.restore.reader import step_dirs
from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import CheckpointNotFound, StagingError
from tests.checkpoint_support import ckpt_config
from tests.helpers.preloaded import PreloadedProcess
from tests.helpers.procs import REPO, WorkerProcess, child_env
from tests.helpers.waiting import wait_until

if TYPE_CHECKING:
    import lightning as L

# Lightning (and DCS's plug-in, which imports it) are imported by the tests that use them, not at collection: the
# import is ~2 s of CPU in every pytest process, most of which never runs a test of this file.
pytestmark = [pytest.mark.integration]
RUN_TIMEOUT = 240.0


def run_dir(config: DCSConfig, run: str) -> Path:
    return Path(config.to_env()["DCS_CHECKPOINT_DIR"]) / run


def committed(config: DCSConfig, run: str) -> list[int]:
    return [step for step, _ in step_dirs(run_dir(config, run))]


def losses_of(path: Path) -> dict[int, str]:
    """global step -> the loss (float.hex) a run recorded for it."""
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return {line["step"]: line["loss"] for line in lines if "step" in line}


def start_run(config: DCSConfig, tmp_path: Path, run: str, name: str, *args: str) -> PreloadedProcess:
    """`python -m tests.integration.lightning_run ...`, forked from the forkserver that already imported torch and DCS
    (tests/helpers/preloaded.py); its stdout goes to NAME.out, its stderr to NAME.log."""
    arguments = [run, str(tmp_path / f"{name}-ckpts"), str(tmp_path / f"{name}.losses"), "40", *args]
    env = child_env(config)
    out, log = tmp_path / f"{name}.out", tmp_path / f"{name}.log"
    out.write_text("")
    log.write_text("")
    return PreloadedProcess("tests.integration.lightning_run", arguments, out, env, REPO, log)


def finish(proc: PreloadedProcess, log: Path) -> dict[str, Any]:
    try:
        proc.wait(RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    out = proc.log.read_text()
    assert proc.returncode == 0, f"exit {proc.returncode}: {out}\n{log.read_text()[-4000:]}"
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def paused(proc: PreloadedProcess, losses: Path) -> bool:
    assert proc.poll() is None, f"the run exited {proc.returncode} before pausing"
    return losses.exists() and '"paused"' in losses.read_text()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_run_killed_mid_training_resumes_from_last_with_the_losses_of_an_uninterrupted_run(
    dcs_config: DCSConfig, tmp_path: Path
) -> None:
    config = ckpt_config(dcs_config, tmp_path)
    whole = start_run(config, tmp_path, "lit-whole", "whole")
    killed = start_run(config, tmp_path, "lit-killed", "killed", "--pause-at", "25")
    try:
        assert finish(whole, tmp_path / "whole.log") == {"done": 40, "committed": [10, 20, 30, 40]}
        wait_until(lambda: paused(killed, tmp_path / "killed.losses"), RUN_TIMEOUT, "the run to reach step 25")
        wait_until(lambda: 20 in committed(config, "lit-killed"), 60, "step 20 to commit")
    finally:
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait(10)
    assert committed(config, "lit-killed") == [10, 20]
    markers = sorted(p.name for p in (tmp_path / "killed-ckpts").iterdir())
    assert markers == ["epoch=0-step=20.ckpt", "last.ckpt"], markers

    (tmp_path / "killed.losses").rename(tmp_path / "before-kill.losses")
    resumed = start_run(config, tmp_path, "lit-killed", "killed", "--resume")
    assert finish(resumed, tmp_path / "killed.log") == {"done": 40, "committed": [10, 20, 30, 40]}

    reference = losses_of(tmp_path / "whole.losses")
    before, after = losses_of(tmp_path / "before-kill.losses"), losses_of(tmp_path / "killed.losses")
    assert sorted(reference) == list(range(40))
    assert before == {s: reference[s] for s in range(25)}  # steps 0-24 ran before the kill
    assert after == {s: reference[s] for s in range(20, 40)}, "resumed at step 20 with the uninterrupted losses"


def fit(
    io: Any, dirpath: Path, model: L.LightningModule, max_steps: int, ckpt_path: str | None = None, **checkpointing: Any
) -> L.Trainer:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    trainer = L.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        plugins=[io],
        callbacks=[ModelCheckpoint(dirpath, **checkpointing)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=dirpath.parent,
    )
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer


def test_a_checkpoint_holding_an_object_is_refused_naming_its_key_and_nothing_is_saved(
    dcs_config: DCSConfig, tmp_path: Path, inline: Any
) -> None:
    from dcs_tasks.integrations.lightning import DCSCheckpointIO
    from tests.integration.lightning_run import TinyModule

    class Unstorable(TinyModule):
        def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            checkpoint["sampler"] = {"seed": 3, "generator": object()}

    config = ckpt_config(dcs_config, tmp_path)
    io = DCSCheckpointIO("lit-bad", config, celery_app=inline(config))
    with pytest.raises(StagingError, match="sampler/generator"):
        fit(io, tmp_path / "ckpts", Unstorable(), 4, every_n_train_steps=2, save_last=True)
    assert committed(config, "lit-bad") == []
    assert not (tmp_path / "ckpts").exists() or list((tmp_path / "ckpts").iterdir()) == []


@pytest.mark.slow
def test_top_k_removals_take_markers_and_dcs_retention_prunes_steps_with_a_worker(
    dcs_config: DCSConfig, tmp_path: Path
) -> None:
    import lightning as L

    from dcs_tasks.integrations.lightning import DCSCheckpointIO
    from tests.integration.lightning_run import TinyModule

    config = ckpt_config(dcs_config, tmp_path)
    worker = WorkerProcess(config, tmp_path / "worker.log").start()
    try:
        io = DCSCheckpointIO("lit-topk", config, keep_last=2)
        torch.manual_seed(0)
        trained = TinyModule()
        fit(io, tmp_path / "ckpts", trained, 40, every_n_train_steps=10, save_last=True)  # save_top_k=1
        assert sorted(p.name for p in (tmp_path / "ckpts").iterdir()) == ["epoch=0-step=40.ckpt", "last.ckpt"]
        # the worker's retention, which follows step 40's commit
        wait_until(lambda: committed(config, "lit-topk") == [30, 40], 30, "retention to keep steps 30 and 40")

        loaded = io.load_checkpoint(tmp_path / "ckpts" / "epoch=0-step=40.ckpt")
        assert loaded["global_step"] == 40 and loaded["pytorch-lightning_version"] == L.__version__
        for name, tensor in trained.state_dict().items():
            assert torch.equal(loaded["state_dict"][name], tensor), name
        io.teardown()
        io.remove_checkpoint(tmp_path / "ckpts" / "epoch=0-step=40.ckpt")
        assert sorted(p.name for p in (tmp_path / "ckpts").iterdir()) == ["last.ckpt"]
        assert committed(config, "lit-topk") == [30, 40]  # the marker only: steps go by retention
    finally:
        worker.discard()


def test_a_file_that_is_not_a_dcs_marker_is_refused_on_load_and_left_on_remove(
    dcs_config: DCSConfig, tmp_path: Path, inline: Any
) -> None:
    from dcs_tasks.integrations.lightning import DCSCheckpointIO, NotADCSCheckpoint

    config = ckpt_config(dcs_config, tmp_path)
    io = DCSCheckpointIO("lit-other", config, celery_app=inline(config))
    plain = tmp_path / "plain.ckpt"
    torch.save({"state_dict": {}}, plain)
    with pytest.raises(NotADCSCheckpoint, match=r"plain\.ckpt"):
        io.load_checkpoint(plain)
    io.remove_checkpoint(plain)
    assert plain.exists()
    io.teardown()


def test_last_resumes_from_the_newest_step_that_commits_and_verifies(
    dcs_config: DCSConfig, tmp_path: Path, inline: Any
) -> None:
    from dcs_tasks.integrations.lightning import DCSCheckpointIO, write_marker
    from tests.integration.lightning_run import TinyModule

    config = ckpt_config(dcs_config, tmp_path)
    io = DCSCheckpointIO("lit-last", config, celery_app=inline(config))
    ckpts = tmp_path / "ckpts"
    fit(io, ckpts, TinyModule(), 30, every_n_train_steps=10, save_last=True, save_top_k=-1)
    assert committed(config, "lit-last") == [10, 20, 30]
    step_30 = run_dir(config, "lit-last") / "step-000000030"
    shutil.rmtree(step_30)  # as if the process died after step 30's save, before its commit
    write_marker(ckpts / "last.ckpt", "lit-last", 30)
    assert io.load_checkpoint(ckpts / "last.ckpt")["global_step"] == 20
    with pytest.raises(CheckpointNotFound, match="step=30"):
        io.load_checkpoint(ckpts / "epoch=0-step=30.ckpt")  # an explicit step is that step or an error

    tensors = next(p for p in (run_dir(config, "lit-last") / "step-000000020").iterdir() if p.suffix == ".safetensors")
    data = bytearray(tensors.read_bytes())
    data[-1] ^= 0xFF  # a flipped bit in step 20's last tensor
    tensors.write_bytes(bytes(data))
    assert io.load_checkpoint(ckpts / "last.ckpt")["global_step"] == 10  # 20 fails its checksum
    io.teardown()


def test_a_run_resumed_past_a_corrupt_step_keeps_it_and_saves_the_next(
    dcs_config: DCSConfig, tmp_path: Path, inline: Any, caplog: pytest.LogCaptureFixture
) -> None:
    from dcs_tasks.integrations.lightning import DCSCheckpointIO
    from tests.integration.lightning_run import TinyModule

    config = ckpt_config(dcs_config, tmp_path)
    io = DCSCheckpointIO("lit-past", config, celery_app=inline(config))
    ckpts = tmp_path / "ckpts"
    fit(io, ckpts, TinyModule(), 20, every_n_train_steps=10, save_last=True)
    tensors = next(p for p in (run_dir(config, "lit-past") / "step-000000020").iterdir() if p.suffix == ".safetensors")
    tensors.write_bytes(tensors.read_bytes()[:-1] + b"\0")  # step 20 no longer verifies

    resumed = fit(io, ckpts, TinyModule(), 30, "last", every_n_train_steps=10, save_last=True)
    assert resumed.global_step == 30
    assert "step 20 of DCS run 'lit-past' is already committed" in caplog.text  # kept, not saved again
    assert committed(config, "lit-past") == [10, 20, 30]
    assert io.load_checkpoint(ckpts / "last.ckpt")["global_step"] == 30
    io.teardown()
