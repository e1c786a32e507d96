"""The memory tier: a save every step costs a copy into this host's memory; storage gets every Nth step; a
restarted trainer restores from memory.

    DCS_MEMORY_TIER_BYTES=1073741824 DCS_STORAGE_EVERY_STEPS=10 dcs up    # another shell
    set -a; . .dcs-run/dcs.env; set +a     # the same settings in this shell (the worker and trainer must agree)
    python examples/memory_tier.py --steps 25

It saves every step, closes, then restores the newest step with a new Checkpointer (as a restarted trainer
would) and prints where it came from (`memory`: this host's memory tier) and how long the restore took.
"""

from __future__ import annotations

import argparse
import time

import torch

from dcs_tasks import Checkpointer, DCSConfig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", default="memtier")
    parser.add_argument("--steps", type=int, default=25)
    args = parser.parse_args(argv)
    config = DCSConfig()
    if config.memory.budget_bytes == 0:
        print("the memory tier is off: set DCS_MEMORY_TIER_BYTES for `dcs up` and this shell")
        return 2
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with Checkpointer(args.run, config) as ckpt:
        for step in range(args.steps):
            opt.zero_grad()
            model(torch.randn(8, 256)).sum().backward()
            opt.step()
            pending = ckpt.save({"model": model.state_dict(), "step": step}, step=step)  # every step
        pending.wait(60)
    with Checkpointer(args.run, config) as restarted:  # a restarted trainer: the newest step, fastest copy
        started = time.perf_counter()
        restored = restarted.restore()
        seconds = time.perf_counter() - started
    same = all(torch.equal(restored.state["model"][k], v) for k, v in model.state_dict().items())
    print(f"restored step {restored.step} from {restored.location} in {seconds * 1000:.1f} ms; bit-exact: {same}")
    return 0 if same and restored.step == args.steps - 1 else 1


if __name__ == "__main__":
    raise SystemExit(main())
