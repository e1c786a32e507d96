"""A Hugging Face `Trainer` run for tests/integration/test_hf_trainer_integration.py, as its own process:

    python -m tests.integration.hf_trainer_run RUN OUTPUT_DIR LOSSES MAX_STEPS [--resume] [--pause-at N]

A one-layer GPT-2 built from its config (nothing from a hub; dropout on, so the RNG state matters) trained by
transformers' own `Trainer` on the CPU over a shuffled fixed dataset, AdamW with a linear schedule, with
`DCSCallback(RUN)` and `save_strategy="steps"`, `save_steps=10`; the saves commit in this process
(`InlineCommitter`: no worker). Every optimizer step appends `{"step": global_step, "loss": float.hex(loss)}` to
LOSSES; `--pause-at N` writes `{"paused": N}` there once step N is done and sleeps (for the test to kill it);
`--resume` trains with `resume_from_checkpoint=callback.resume_from_checkpoint()`. Settings: `DCS_*`.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

from dcs_tasks.checkpoint.inline import InlineCommitter
from dcs_tasks.checkpoint.restore.reader import step_dirs
from dcs_tasks.config import DCSConfig
from dcs_tasks.integrations.hf import DCSCallback

SAVE_EVERY = 10


def tiny_model() -> GPT2LMHeadModel:
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    return GPT2LMHeadModel(config)


def dataset(rows: int = 400) -> list[dict[str, torch.Tensor]]:
    tokens = torch.randint(0, 64, (rows, 16), generator=torch.Generator().manual_seed(7))
    return [{"input_ids": row, "labels": row} for row in tokens]


class RecordingTrainer(Trainer):
    """Appends each training batch's loss, with the global step it belongs to, to `losses`."""

    losses: Path | None = None

    def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        if self.losses is not None and model.training:
            value = loss[0] if isinstance(loss, tuple) else loss
            with self.losses.open("a") as out:
                out.write(json.dumps({"step": self.state.global_step, "loss": float(value).hex()}) + "\n")
        return loss


class PauseAt(TrainerCallback):
    def __init__(self, step: int, losses: Path) -> None:
        self.step, self.losses = step, losses

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        if state.global_step == self.step:
            with self.losses.open("a") as out:
                out.write(json.dumps({"paused": self.step}) + "\n")
            time.sleep(3600)  # the test kills this process


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run")
    parser.add_argument("output_dir", type=Path)
    parser.add_argument("losses", type=Path)
    parser.add_argument("max_steps", type=int)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--pause-at", type=int)
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = DCSConfig()
    committer = InlineCommitter(config)
    dcs = DCSCallback(args.run, config, celery_app=committer)
    callbacks: list[TrainerCallback] = [dcs]
    if args.pause_at is not None:
        callbacks.insert(0, PauseAt(args.pause_at, args.losses))  # before DCSCallback: step 25 is not saved
    training = TrainingArguments(
        output_dir=str(args.output_dir),
        max_steps=args.max_steps,
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        lr_scheduler_type="linear",
        warmup_steps=5,
        save_strategy="steps",
        save_steps=SAVE_EVERY,
        logging_steps=5,
        report_to=[],
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    torch.manual_seed(0)
    trainer = RecordingTrainer(model=tiny_model(), args=training, train_dataset=dataset(), callbacks=callbacks)
    trainer.losses = args.losses
    resume = dcs.resume_from_checkpoint() if args.resume else None
    trainer.train(resume_from_checkpoint=resume)
    committed = [step for step, _ in step_dirs(Path(os.environ["DCS_CHECKPOINT_DIR"]) / args.run)]
    committer.close()
    left = resume is not None and Path(resume).exists()  # the temporary resume folder, after training
    print(json.dumps({"done": trainer.state.global_step, "committed": committed, "resume_folder_left": left}))


if __name__ == "__main__":
    main()
