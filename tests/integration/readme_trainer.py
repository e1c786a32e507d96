"""The README's trainer, run as a user runs it: its own lines executed, with `DCS_*` settings in the environment,
a tiny model and a training step that takes a few milliseconds. `run_readme_trainer` says how it ended: normally
(what `close()` returned) or by an exception, and when, counted from the first save."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from dcs_tasks.config import DCSConfig
from tests.integration.test_readme_example import README, readme_example

SAVE_EVERY = 100  # the README saves every 100 steps


@dataclass
class TrainerRun:
    """How the README trainer ended: `raised` (None: it returned), the steps it trained, and when."""

    raised: BaseException | None
    steps_trained: int
    closed: object = None
    step_started_at: list[float] = field(default_factory=list)
    ended_at: float = 0.0

    def seconds_after_save(self, step: int) -> float:
        """Seconds from the return of `save(step=step)` (the next step's start) to the end of the run."""
        return self.ended_at - self.step_started_at[step + 1]


def trainer_env(monkeypatch: pytest.MonkeyPatch, config: DCSConfig) -> None:
    """The trainer's shell: `config` as DCS_* variables (what a user exports), metrics off."""
    for name, value in config.to_env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("DCS_ENABLE_METRICS", "false")


def run_readme_trainer(steps: int, step_seconds: float = 0.005) -> TrainerRun:
    """Execute the README's trainer for `steps` steps in this process (a fresh model, as a new trainer process)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    started: list[float] = []

    def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        started.append(time.monotonic())
        opt.zero_grad()
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        time.sleep(step_seconds)

    namespace: dict[str, object] = {"model": model, "opt": opt, "train_step": train_step, "steps": steps}
    namespace |= {"lr": 0.01, "torch": torch}
    raised: BaseException | None = None
    try:
        exec(compile(readme_example(), str(README), "exec"), namespace)
    except (Exception, SystemExit) as exc:  # what the user's trainer would die of, with its message
        raised = exc
    ended = time.monotonic()
    closed = namespace.get("closed")
    return TrainerRun(raised, len(started), closed, started, ended)


SCRIPT_HEAD = """\
import time
import torch
torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
opt = torch.optim.AdamW(model.parameters(), lr=0.01)
lr, steps = 0.01, 250
def train_step(model, opt):
    opt.zero_grad()
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    time.sleep(0.005)
"""


def readme_trainer_script(path: Path) -> Path:
    """The README's trainer as the file a user runs (`python path`): a tiny model, then the README's lines."""
    path.write_text(SCRIPT_HEAD + readme_example() + 'print("trainer finished")\n')
    return path


def failures_counted(kind: str) -> float:
    """`dcs_ckpt_save_failures_total{kind=...}` of this process (the trainer's), 0 before any."""
    from dcs_tasks.metrics import get_metrics

    value = get_metrics().registry.get_sample_value("dcs_ckpt_save_failures_total", {"kind": kind})
    return value or 0.0


def checkpoint_dir_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) if root.exists() else []
