"""A trainer in a real 1-process gloo group saving a DTensor and a nested tensor:
`python -m tests.integration.unstageable_trainer PORT OUT` (config from the DCS_* environment).

Each save's outcome (the error class and message, or "saved") goes to OUT as JSON, followed by the step a
plain save committed afterwards: a save() that crashes the process (SIGSEGV) writes nothing.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial

from dcs_tasks import Checkpointer
from dcs_tasks.config import DCSConfig


def attempt(ckpt: Checkpointer, state: Any, step: int) -> str:
    try:
        ckpt.save(state, step=step).wait(60)
    except Exception as exc:  # the outcome is what the test reads
        return f"{type(exc).__name__}: {exc}"
    return "saved"


def main() -> None:
    port, out = int(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        mesh = DeviceMesh("cpu", [0])
        weight = DTensor.from_local(torch.randn(8, 4), mesh, [Partial()])  # a pending sum: DCS refuses it
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "nested tensors are a prototype"
            nested = torch.nested.nested_tensor([torch.randn(2), torch.randn(3)])
        seen: dict[str, Any] = {}
        with Checkpointer("unstageable", DCSConfig()) as ckpt:
            seen["dtensor"] = attempt(ckpt, {"model": {"w": weight, "b": torch.zeros(4)}, "step": 1}, 1)
            seen["nested"] = attempt(ckpt, {"optim": {"state": [nested]}}, 1)
            plain = {"model": {"w": weight.full_tensor(), "b": torch.zeros(4)}}
            seen["plain"] = attempt(ckpt, plain, 1)
            seen["restored"] = torch.equal(ckpt.restore(step=1).state["model"]["w"], plain["model"]["w"])
        out.write_text(json.dumps(seen))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
