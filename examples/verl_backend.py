"""verl's checkpoint engine over DCS: a trainer pushes its weights to a rollout worker through the "dcs" backend.

    pip install verl                          # verl's own install (docs/integrations/verl.md)
    dcs up                                    # another shell: coordinator and worker
    set -a; . .dcs-run/dcs.env; set +a        # DCS_COORDINATOR_URL, DCS_AUTH_TOKEN, ...
    python examples/verl_backend.py

In a verl job the three config lines of docs/integrations/verl.md do all of this: verl imports
`dcs_tasks.integrations.verl` on every worker, builds the engines from its registry and runs each update
(prepare, build_topology, init_process_group, send/receive, finalize). Here this script plays verl's manager for
one trainer (this process, verl's trainer rank 0) and one rollout worker (a child process), for two updates, and
prints what the rollout worker received.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
from collections.abc import AsyncIterator
from multiprocessing.connection import Connection
from typing import Any

import torch
from verl.checkpoint_engine import CheckpointEngineRegistry
from verl.utils.import_utils import import_external_libs

from dcs_tasks.sync.receiving import tensor_sha256

BUCKET = 1 << 20  # verl: rollout.checkpoint_engine.update_weights_bucket_megabytes << 20
ENGINE_KWARGS = {"model_name": "verl-example"}  # verl: rollout.checkpoint_engine.engine_kwargs.dcs


def digest(weights: dict[str, torch.Tensor]) -> dict[str, str]:
    return {name: tensor_sha256(t) for name, t in sorted(weights.items())}


async def collect(pairs: AsyncIterator[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() async for name, tensor in pairs}


def rollout_worker(conn: Connection) -> None:
    """A verl rollout worker's side: the engine as verl's CheckpointEngineWorker builds it (no is_master)."""
    import_external_libs("dcs_tasks.integrations.verl")  # verl: checkpoint_engine.custom_backend_module
    engine = CheckpointEngineRegistry.new("dcs", bucket_size=BUCKET, **ENGINE_KWARGS)
    try:
        while (message := conn.recv()) != "close":
            op, kwargs = message
            if op == "prepare":
                conn.send(engine.prepare())
            elif op == "init":
                engine.init_process_group(**kwargs)
                conn.send("joined")
            elif op == "receive":
                got = asyncio.run(collect(engine.receive_weights()))
                conn.send((engine.client.weight_version, digest(got)))
            elif op == "finalize":
                engine.finalize()
                conn.send("done")
    finally:
        engine.close()
    conn.send("closed")  # the trainer goes on now: waiting for this interpreter's exit costs it seconds


def update(trainer: Any, conn: Connection, model: torch.nn.Module) -> tuple[dict[str, Any], int, bool]:
    """One update as verl's CheckpointEngineManager runs it; (trainer's metrics, rollout version, bit-exact)."""
    conn.send(("prepare", {}))
    metadata = [trainer.prepare(), conn.recv()]
    actor_kwargs, rollout_kwargs = type(trainer).build_topology(1, 1, metadata)
    conn.send(("init", {k: v[0] for k, v in rollout_kwargs.items()}))
    trainer.init_process_group(**{k: v[0] for k, v in actor_kwargs.items()})  # both join at once
    assert conn.recv() == "joined"
    conn.send(("receive", {}))
    state = model.state_dict()
    metrics = asyncio.run(trainer.send_weights(item for item in state.items()))  # verl's (name, tensor) generator
    version, received = conn.recv()
    trainer.finalize()
    conn.send(("finalize", {}))
    conn.recv()
    return metrics, version, received == digest(state)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--updates", type=int, default=2)
    args = parser.parse_args(argv)
    import_external_libs("dcs_tasks.integrations.verl")
    trainer = CheckpointEngineRegistry.new("dcs", is_master=True, bucket_size=BUCKET, **ENGINE_KWARGS)
    print(f"verl's registry gave {type(trainer).__module__}.{type(trainer).__name__}")
    conn, child_end = multiprocessing.get_context("spawn").Pipe()
    child = multiprocessing.get_context("spawn").Process(target=rollout_worker, args=(child_end,), daemon=True)
    child.start()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.ReLU(), torch.nn.Linear(128, 16))
    exact = True
    try:
        for step in range(1, args.updates + 1):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01 * torch.randn_like(p))  # a training step
            metrics, version, same = update(trainer, conn, model)
            exact &= same
            print(f"update {step}: sent {metrics['dcs/bytes']} bytes in {metrics['dcs/buckets']} buckets")
            print(f"rollout worker: weight version {version}, bit-exact: {same}")
    finally:
        conn.send("close")
        try:  # until the rollout worker closed its engine (a daemon: it is ended at this process's exit)
            if conn.poll(60):
                conn.recv()
        except EOFError:  # it is gone already
            pass
        trainer.close()
    return 0 if exact else 1


if __name__ == "__main__":
    raise SystemExit(main())
