"""The demo's trainer process: `python -m dcs_tasks.local.trainer --steps N --save-every K [--resume]`.

Settings (Redis, coordinator, token, checkpoint dir) come from the `DCS_*` environment the demo gives it.
It reports on stdout, one JSON object a line, so the demo can draw progress, kill it mid-run and check the
resume: `start` (state size, the time a plain copy of the state takes), `restored`, `step`, `save` (stall,
digest of the state saved) and `done`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch

from dcs_tasks.checkpoint import Checkpointer
from dcs_tasks.config import DCSConfig
from dcs_tasks.local.charlm import Corpus, make_model, state_digest, train_step, training_state

BATCH = 16
LR = 3e-3
COMMIT_TIMEOUT_SECONDS = 120.0


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"ev": event, "t": time.time(), **fields}), flush=True)


def memcpy_seconds(state: dict[str, Any], repeats: int = 5) -> float:
    """Median time of copying every tensor of `state` into preallocated memory: the floor of a save stall."""
    tensors = [t for part in (state["model"], state["rng"]) for t in _tensors(part)]
    tensors += [t for values in state["optim"]["state"].values() for t in _tensors(values)]
    targets = [torch.empty_like(t) for t in tensors]
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        for dst, src in zip(targets, tensors, strict=True):
            dst.copy_(src)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def nbytes(state: dict[str, Any]) -> int:
    parts = _tensors(state["model"]) + _tensors(state["rng"])
    parts += [t for values in state["optim"]["state"].values() for t in _tensors(values)]
    return sum(t.numel() * t.element_size() for t in parts)


def restore(ckpt: Checkpointer, model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """Load the newest committed checkpoint that verifies; returns the next step to train."""
    started = time.perf_counter()
    restored = ckpt.restore()
    model.load_state_dict(restored.state["model"])
    opt.load_state_dict(restored.state["optim"])
    torch.set_rng_state(restored.state["rng"])
    emit("restored", step=restored.step, seconds=time.perf_counter() - started, digest=state_digest(model, opt))
    return int(restored.state["step"]) + 1


def train(args: argparse.Namespace) -> None:
    corpus = Corpus.load()
    model = make_model(corpus.vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    torch.manual_seed(1234)
    with Checkpointer(args.run, DCSConfig()) as ckpt:
        first = restore(ckpt, model, opt) if args.resume else 1
        if first == 1:
            train_step(model, opt, corpus, 0, BATCH)  # warm-up step 0: creates the optimizer state to measure
        state = training_state(model, opt, first - 1)
        params = sum(p.numel() for p in model.parameters())
        emit("start", first=first, params=params, state_bytes=nbytes(state), memcpy=memcpy_seconds(state))
        last = None
        for step in range(first, args.steps + 1):
            t0 = time.time()
            loss = train_step(model, opt, corpus, step, BATCH)
            emit("step", step=step, loss=loss, t0=t0)
            if step % args.save_every == 0 or step == args.steps:
                started = time.time()
                last = ckpt.save(training_state(model, opt, step), step=step, metadata={"lr": LR})
                emit("save", step=step, t0=started, stall=last.stall_seconds, digest=state_digest(model, opt))
        if last is not None:
            info = last.wait(timeout=COMMIT_TIMEOUT_SECONDS)
            emit("done", step=info.step, digest=state_digest(model, opt))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dcs_tasks.local.trainer", description=__doc__)
    parser.add_argument("--run", default="demo")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--save-every", type=int, required=True)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1, see docs/local.md)")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, args.threads))
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
