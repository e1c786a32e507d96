"""The README's trainer example, as written, against a real worker: a run that is stopped and started again
resumes from its newest committed step with the model, optimizer and RNG it saved (the example's own lines
are executed; only `model`, `opt`, `train_step`, `steps` and `lr` come from here, through `DCS_*` settings)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from dcs_tasks.config import DCSConfig
from tests.checkpoint_support import ckpt_config
from tests.helpers.procs import WorkerProcess

pytestmark = [pytest.mark.integration, pytest.mark.slow]
README = Path(__file__).resolve().parents[2] / "README.md"


def readme_example() -> str:
    text = README.read_text()
    section = text[text.index("## A trainer that checkpoints and resumes") :]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None, "the README lost its trainer example"
    return match.group(1)


def run_example(code: str, steps: int) -> dict[str, object]:
    """Execute the example with a fresh model and optimizer, as a restarted trainer process would have."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    seen: list[dict[str, torch.Tensor]] = []  # the weights each training step started from

    def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        seen.append({k: v.clone() for k, v in model.state_dict().items()})
        opt.zero_grad()
        model(torch.randn(2, 8)).sum().backward()
        opt.step()

    namespace: dict[str, object] = {"model": model, "opt": opt, "train_step": train_step, "steps": steps}
    namespace |= {"lr": 0.01, "torch": torch}
    exec(compile(code, str(README), "exec"), namespace)  # the README's own example
    namespace["trained"] = seen
    return namespace


def test_the_readme_trainer_resumes_where_its_last_committed_save_left_off(
    dcs_config: DCSConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = ckpt_config(dcs_config, tmp_path)
    for name in ("redis_url", "checkpoint_dir", "staging_dir", "node_name"):
        monkeypatch.setenv(f"DCS_{name.upper()}", str(config.value(name)))
    monkeypatch.setenv("DCS_ENABLE_METRICS", "false")
    worker = WorkerProcess(config, tmp_path / "worker.log").start()
    try:
        code = readme_example()
        first = run_example(code, steps=250)  # saves steps 0, 100 and 200; close() waits for them
        assert first["start"] == 0 and "restored" not in first  # nothing to resume on the first run
        saved_at_200 = first["trained"][201]  # type: ignore[index]  # the weights step 200's save held
        second = run_example(code, steps=260)  # a restarted trainer with a fresh model
        restored = second["restored"]
        assert restored.step == 200 and restored.metadata == {"lr": 0.01}  # type: ignore[attr-defined]
        trained = second["trained"]
        assert second["start"] == 201 and len(trained) == 59  # type: ignore[arg-type]
        resumed_from = trained[0]  # type: ignore[index]
        assert all(torch.equal(resumed_from[k], saved_at_200[k]) for k in saved_at_200)  # bit-exact
    finally:
        worker.discard()
