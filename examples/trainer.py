"""The README's trainer, runnable: a small model trained for `--steps` steps with a checkpoint every `--save-every`
steps; started again, it resumes from the newest committed step with the model, optimizer and RNG it saved.

    dcs up                                   # another shell; writes .dcs-run/dcs.env
    set -a; . .dcs-run/dcs.env; set +a       # the DCS_* settings of that stack
    python examples/trainer.py --steps 300   # saves steps 0, 100 and 200
    python examples/trainer.py --steps 400   # resumes at step 201, saves 300

Everything DCS needs comes from the `DCS_*` environment (`DCSConfig()`). Exits 1 when a save failed or was not
finished by `close()`.
"""

from __future__ import annotations

import argparse

import torch

from dcs_tasks import Checkpointer, DCSConfig

LR = 0.01


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.randn(16, 64)).pow(2).mean().backward()
    opt.step()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", default="exp1", help="run name (default exp1)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--save-every", type=int, default=100)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)

    ckpt = Checkpointer(args.run, DCSConfig())  # DCS_* environment: DCS_REDIS_URL, DCS_CHECKPOINT_DIR, ...
    start = 0
    if ckpt.list():  # resume: the newest committed step that verifies
        restored = ckpt.restore()
        model.load_state_dict(restored.state["model"])
        opt.load_state_dict(restored.state["optim"])
        torch.set_rng_state(restored.state["rng"])
        start = restored.step + 1
        print(f"resumed from step {restored.step} ({restored.location})")
    for step in range(start, args.steps):
        train_step(model, opt)
        if step % args.save_every == 0:
            state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": step, "rng": torch.get_rng_state()}
            ckpt.save(state, step=step, metadata={"lr": LR})  # returns once staged; a worker writes it
    closed = ckpt.close()  # waits for saves in flight (bounded); raises SaveFailed for a failed one
    if not closed.ok:
        print(f"checkpoints not saved: failed steps {closed.failed}, unfinished {closed.unfinished}")
        return 1
    print(f"trained steps {start}-{args.steps - 1}; committed steps: {[info.step for info in ckpt.list()]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
