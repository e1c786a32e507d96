"""PyTorch Lightning saving through DCS: `Trainer(plugins=[DCSCheckpointIO(run)])` and `ckpt_path="last"`.

    dcs up                                             # another shell (a worker on this host, Redis)
    set -a; . .dcs-run/dcs.env; set +a                 # the same settings in this shell
    python examples/lightning_trainer.py --steps 30    # saves steps 10, 20, 30
    python examples/lightning_trainer.py --steps 50    # resumes from step 30, saves 40 and 50

A small LightningModule trained by Lightning's own `Trainer` with `ModelCheckpoint(every_n_train_steps=10,
save_last=True)`; each checkpoint is a committed DCS step (`dcs ckpt list --run lightning-example`), and `--dir`
holds only Lightning's markers. Started again it resumes from the newest verified step. docs/integrations/lightning.md
has the details.
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader

from dcs_tasks import DCSConfig
from dcs_tasks.integrations.lightning import DCSCheckpointIO


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(self.global_step))
        return torch.nn.functional.mse_loss(self.net(x), x.sum(dim=1, keepdim=True).sin())

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(list(range(1000)), batch_size=1)


class SayWhereItStarts(Callback):
    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if trainer.global_step:
            print(f"resumed from step {trainer.global_step}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", default="lightning-example")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--dir", type=Path, default=Path(".dcs-run/lightning-example"), help="Lightning's markers")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    torch.manual_seed(0)
    io = DCSCheckpointIO(args.run, DCSConfig())  # DCS_* environment: DCS_REDIS_URL, DCS_CHECKPOINT_DIR, ...
    trainer = L.Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        plugins=[io],
        callbacks=[ModelCheckpoint(args.dir, every_n_train_steps=10, save_last=True), SayWhereItStarts()],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regression(), ckpt_path="last")  # the end of fit waits for the saves in flight
    steps = [info.step for info in io.checkpointer.list()]
    io.teardown()
    print(f"trained to step {trainer.global_step}; committed steps: {steps}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
