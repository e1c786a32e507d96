"""A Lightning training run for tests/integration/test_lightning_integration.py, as its own process:

    python -m tests.integration.lightning_run RUN DIRPATH LOSSES MAX_STEPS [--resume] [--pause-at N]

A small LightningModule (AdamW, a StepLR stepped every batch) trained by Lightning's own `Trainer` on the CPU with
`DCSCheckpointIO(RUN)` and `ModelCheckpoint(DIRPATH, every_n_train_steps=10, save_last=True)`; the saves commit in
this process (`InlineCommitter`: no worker). Each step's input comes from a generator seeded with the global step,
so a resumed run sees the same batches as an uninterrupted one from the step it resumes at. Every step appends
`{"step": global_step, "loss": float.hex(loss)}` to LOSSES; `--pause-at N` writes `{"paused": N}` there once step
N is done and then sleeps (for the test to kill it); `--resume` fits with `ckpt_path="last"`. Settings: `DCS_*`.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader

from dcs_tasks.checkpoint.inline import InlineCommitter
from dcs_tasks.checkpoint.restore.reader import step_dirs
from dcs_tasks.config import DCSConfig
from dcs_tasks.integrations.lightning import DCSCheckpointIO

SAVE_EVERY = 10


class TinyModule(L.LightningModule):
    def __init__(self, width: int = 16, lr: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))
        self.losses: Path | None = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        data = torch.Generator().manual_seed(1000 + self.global_step)
        x = torch.randn(8, self.hparams["width"], generator=data)
        y = x.sum(dim=1, keepdim=True).sin()
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        if self.losses is not None:
            with self.losses.open("a") as out:
                out.write(json.dumps({"step": self.global_step, "loss": float(loss).hex()}) + "\n")
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"])
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(list(range(10_000)), batch_size=1)


class PauseAt(Callback):
    def __init__(self, step: int, losses: Path) -> None:
        self.step, self.losses = step, losses

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            with self.losses.open("a") as out:
                out.write(json.dumps({"paused": self.step}) + "\n")
            time.sleep(3600)  # the test kills this process


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run")
    parser.add_argument("dirpath", type=Path)
    parser.add_argument("losses", type=Path)
    parser.add_argument("max_steps", type=int)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--pause-at", type=int)
    args = parser.parse_args()
    torch.set_num_threads(1)
    L.seed_everything(0)
    config = DCSConfig()
    committer = InlineCommitter(config)
    io = DCSCheckpointIO(args.run, config, celery_app=committer)
    callbacks: list[Callback] = [ModelCheckpoint(args.dirpath, every_n_train_steps=SAVE_EVERY, save_last=True)]
    if args.pause_at is not None:
        callbacks.append(PauseAt(args.pause_at, args.losses))
    trainer = L.Trainer(
        max_steps=args.max_steps,
        accelerator="cpu",
        devices=1,
        plugins=[io],
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args.dirpath.parent,
    )
    model = TinyModule()
    model.losses = args.losses
    trainer.fit(model, ckpt_path="last" if args.resume else None)  # its teardown waits for the saves
    committed = [step for step, _ in step_dirs(Path(os.environ["DCS_CHECKPOINT_DIR"]) / args.run)]
    committer.close()
    print(json.dumps({"done": trainer.global_step, "committed": committed}))


if __name__ == "__main__":
    main()
