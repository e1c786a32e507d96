"""torch DCP saving through DCS: `dcp.async_save` / `dcp.load` with DCS's storage writer and reader.

    dcs up                                  # another shell (a worker on this host, Redis)
    set -a; . .dcs-run/dcs.env; set +a      # the same settings in this shell
    python examples/dcp_save.py --steps 30

It trains a small model, saves `{"model", "optim"}` with `dcp.async_save(..., storage_writer=DCSStorageWriter(...))`
every 10 steps (each save a committed DCS step: `dcs ckpt list --run dcp-example` shows them), then loads the newest
step into a fresh model and optimizer with `dcp.load(..., storage_reader=DCSStorageReader(run))`, as a restarted
trainer would, and checks the weights are bit-exact. docs/integrations/dcp.md has the details.
"""

from __future__ import annotations

import argparse
import warnings

import torch
import torch.distributed.checkpoint as dcp

from dcs_tasks import Checkpointer, DCSConfig
from dcs_tasks.integrations.dcp import DCSStorageReader, DCSStorageWriter


def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", default="dcp-example")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=10)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process, no process group
    config = DCSConfig()
    model, optimizer = build(0)
    saves = []
    with Checkpointer(args.run, config) as ckpt:  # kept across saves: its staging buffers stay mapped
        for step in range(1, args.steps + 1):
            optimizer.zero_grad()
            model(torch.randn(16, 64)).square().mean().backward()
            optimizer.step()
            if step % args.every == 0:
                if saves:
                    saves[-1].result()  # one save in flight at a time
                state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
                saves.append(dcp.async_save(state, storage_writer=DCSStorageWriter(ckpt, step=step)))
        for future in saves:
            future.result()
        print(f"committed steps: {[info.step for info in ckpt.list()]}")

    fresh_model, fresh_optimizer = build(1)  # a restarted trainer
    into = {"model": fresh_model.state_dict(), "optim": fresh_optimizer.state_dict()}
    reader = DCSStorageReader(args.run, config=config)
    dcp.load(into, storage_reader=reader)
    fresh_model.load_state_dict(into["model"])
    fresh_optimizer.load_state_dict(into["optim"])
    saved, loaded = model.state_dict(), fresh_model.state_dict()
    same = saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
    print(f"loaded step {reader.chosen_step} with dcp.load, bit-exact: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
