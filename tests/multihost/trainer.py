"""A trainer rank as it runs on a simulated host: `python -m tests.multihost.trainer RUN RANK WORLD`.

Configured like a real trainer, from the `DCS_*` environment (no node name: the Checkpointer finds its host's
queue by the hostname). Driven by JSON lines on stdin, one JSON answer per line on stdout:

  {"op": "save", "step": S, "wait": T}   save this rank's part of step S; wait up to T s (null: don't)
  {"op": "wait", "step": S, "timeout": T}
  {"op": "restore", "step": S}             digests of this rank's restored part (at this world size) of
                                           step S (absent: the newest complete step)
  {"op": "exit"}

An error is answered as {"ok": false, "error": "<DCSError subclass>: message"}.
"""

from __future__ import annotations

import hashlib
import json
import socket
import sys
from typing import Any

import torch

from dcs_tasks import Checkpointer
from dcs_tasks.checkpoint.pending import PendingCheckpoint
from dcs_tasks.config import DCSConfig

ROWS, COLS = 2048, 128  # float32: 1 MiB in all, 256 KiB per rank at W=4
SHARDING = {"model/w": 0, "model/col": 1}


def global_state(step: int, world: int) -> dict[str, torch.Tensor]:
    """The unsharded tensors every rank's part of `step` comes from."""
    g = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(ROWS, COLS, generator=g),
        "col": torch.randn(3, 2 * world + 1, generator=g).to(torch.bfloat16),
    }


def rank_state(step: int, rank: int, world: int) -> dict[str, Any]:
    """What rank `rank` of `world` saves at `step`: its dim-split parts plus rank-local values."""
    full = global_state(step, world)
    return {
        "model": {
            "w": torch.tensor_split(full["w"], world, 0)[rank].clone(),
            "col": torch.tensor_split(full["col"], world, 1)[rank].clone(),
        },
        "rng": torch.full((4,), float(rank * 1000 + step)),
        "step": step,
    }


def digest(t: torch.Tensor) -> str:
    data = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return f"{t.dtype}:{tuple(t.shape)}:{hashlib.sha256(data).hexdigest()}"


def digests(state: dict[str, Any]) -> dict[str, Any]:
    model = state["model"]
    return {"w": digest(model["w"]), "col": digest(model["col"]), "rng": digest(state["rng"]), "step": state["step"]}


class Trainer:
    def __init__(self, run: str, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.ckpt = Checkpointer(run, DCSConfig(), rank=rank, world_size=world)
        self.pending: dict[int, PendingCheckpoint] = {}

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["op"]
        if op == "whoami":
            return {"hostname": socket.gethostname(), "node": self.ckpt.config.host_name}
        if op == "save":
            step = int(cmd["step"])
            pending = self.ckpt.save(rank_state(step, self.rank, self.world), step, sharding=SHARDING)
            self.pending[step] = pending
            if cmd.get("wait") is None:
                return {"status": "staged", "step_dir": str(pending.step_dir)}
            return self.wait(step, float(cmd["wait"]))
        if op == "wait":
            return self.wait(int(cmd["step"]), float(cmd["timeout"]))
        if op == "restore":
            restored = self.ckpt.restore(step=cmd.get("step"))
            answer = {"step": restored.step, "digests": digests(restored.state)}
            return {**answer, "location": restored.location} if cmd.get("location") else answer
        raise ValueError(f"unknown op {op!r}")

    def wait(self, step: int, timeout: float) -> dict[str, Any]:
        info = self.pending[step].wait(timeout=timeout)
        return {"status": "committed", "path": str(info.path)}


def main() -> None:
    run, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    trainer = Trainer(run, rank, world)
    print(json.dumps({"ok": True, "ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            break
        try:
            answer = {"ok": True, **trainer.handle(cmd)}
        except Exception as exc:
            answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(answer), flush=True)
    trainer.ckpt.close()


if __name__ == "__main__":
    main()
