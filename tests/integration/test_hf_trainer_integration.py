"""`DCSCallback` (dcs_tasks/integrations/hf.py) under transformers' own `Trainer`, on the CPU with a one-layer
GPT-2 built from its config: a run killed with SIGKILL mid-training resumes from the newest committed step through
`resume_from_checkpoint()` and trains on with the losses of an uninterrupted run, with no `checkpoint-N` folder
written; a state DCS cannot store is refused naming its key, with nothing saved."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from dcs_tasks.checkpoint.restore.reader import step_dirs
from dcs_tasks.config import DCSConfig
from tests.checkpoint_support import ckpt_config
from tests.helpers.preloaded import PreloadedProcess
from tests.helpers.procs import REPO, child_env
from tests.helpers.waiting import wait_until

pytestmark = [pytest.mark.integration]
RUN_TIMEOUT = 300.0


def run_dir(config: DCSConfig, run: str) -> Path:
    return Path(config.to_env()["DCS_CHECKPOINT_DIR"]) / run


def committed(config: DCSConfig, run: str) -> list[int]:
    return [step for step, _ in step_dirs(run_dir(config, run))]


def losses_of(path: Path) -> dict[int, str]:
    """global step -> the loss (float.hex) a run recorded for the batch of that step."""
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return {line["step"]: line["loss"] for line in lines if "step" in line}


def start_run(config: DCSConfig, tmp_path: Path, run: str, name: str, *args: str) -> PreloadedProcess:
    """`python -m tests.integration.hf_trainer_run ...`, forked from the forkserver that already imported torch and DCS
    (tests/helpers/preloaded.py); its stdout goes to NAME.out, its stderr to NAME.log."""
    arguments = [run, str(tmp_path / f"{name}-out"), str(tmp_path / f"{name}.losses"), "40", *args]
    env = child_env(config, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    out, log = tmp_path / f"{name}.out", tmp_path / f"{name}.log"
    out.write_text("")
    log.write_text("")
    return PreloadedProcess("tests.integration.hf_trainer_run", arguments, out, env, REPO, log)


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
@pytest.mark.timeout(1200)
def test_a_run_killed_mid_training_resumes_from_dcs_with_the_losses_of_an_uninterrupted_run(
    dcs_config: DCSConfig, tmp_path: Path
) -> None:
    config = ckpt_config(dcs_config, tmp_path)
    whole = start_run(config, tmp_path, "hf-whole", "whole")
    killed = start_run(config, tmp_path, "hf-killed", "killed", "--pause-at", "25")
    try:
        assert finish(whole, tmp_path / "whole.log") == {
            "done": 40,
            "committed": [10, 20, 30, 40],
            "resume_folder_left": False,
        }
        wait_until(lambda: paused(killed, tmp_path / "killed.losses"), RUN_TIMEOUT, "the run to reach step 25")
        wait_until(lambda: 20 in committed(config, "hf-killed"), 60, "step 20 to commit")
    finally:
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait(10)
    assert committed(config, "hf-killed") == [10, 20]

    (tmp_path / "killed.losses").rename(tmp_path / "before-kill.losses")
    resumed = start_run(config, tmp_path, "hf-killed", "killed", "--resume")
    assert finish(resumed, tmp_path / "killed.log") == {
        "done": 40,
        "committed": [10, 20, 30, 40],
        "resume_folder_left": False,
    }

    reference = losses_of(tmp_path / "whole.losses")
    before, after = losses_of(tmp_path / "before-kill.losses"), losses_of(tmp_path / "killed.losses")
    assert sorted(reference) == list(range(40))
    assert before == {s: reference[s] for s in range(25)}  # steps 0-24 ran before the kill
    assert after == {s: reference[s] for s in range(20, 40)}, "resumed at step 20 with the uninterrupted losses"
    for name in ("whole", "killed"):  # the Trainer wrote no checkpoint folder: DCS holds them
        out = tmp_path / f"{name}-out"
        assert not out.exists() or not any(p.name.startswith("checkpoint-") for p in out.iterdir())


def test_a_state_holding_an_object_is_refused_naming_its_key_and_nothing_is_saved(
    dcs_config: DCSConfig, tmp_path: Path, inline: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import Trainer, TrainingArguments

    from dcs_tasks.errors import StagingError
    from dcs_tasks.integrations.hf import DCSCallback
    from tests.integration.hf_trainer_run import dataset, tiny_model

    config = ckpt_config(dcs_config, tmp_path)
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer.param_groups[0]["owner"] = object()  # a custom optimizer's extra, not plain data
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=3, save_strategy="steps", save_steps=2, report_to=[], use_cpu=True
    )
    dcs = DCSCallback("hf-bad", config, celery_app=inline(config))
    trainer = Trainer(
        model=model, args=args, train_dataset=dataset(8), optimizers=(optimizer, scheduler), callbacks=[dcs]
    )
    with pytest.raises(StagingError, match="optimizer/param_groups/0/owner"):
        trainer.train()
    dcs.close()
    assert committed(config, "hf-bad") == []
    out = tmp_path / "out"
    assert not out.exists() or not any(p.name.startswith("checkpoint-") for p in out.iterdir())
