"""One node of the actor -> actor_fwd / reference test, run as `python -m tests.distributed.fwd_ref_node`.

Config comes from DCS_* env; results go to `--out` as JSON: {rollout_id: {"version": v, "digest": {...}}}.
Actors hold `stage{pp_rank}.*` tensors (mixed dtypes) changed deterministically per rollout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from dcs_tasks.client.engine import CheckpointEngineClient
from dcs_tasks.config import DCSConfig
from dcs_tasks.sync.receiving import tensor_sha256


def stage_state(pp_rank: int, rollout_id: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * pp_rank + rollout_id)
    state = {f"stage{pp_rank}.w{i}": torch.randn(17, 5 + i, generator=g) for i in range(12)}
    state[f"stage{pp_rank}.bf16"] = torch.randn(64, generator=g).to(torch.bfloat16)
    state[f"stage{pp_rank}.count"] = torch.tensor([rollout_id, pp_rank], dtype=torch.int64)
    return state


def digest(state: dict[str, torch.Tensor]) -> dict[str, str]:
    return {name: tensor_sha256(t) for name, t in state.items()}


def wait_for_roles(url: str, expect: dict[str, int], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        nodes = httpx.get(f"{url}/topology", timeout=10).json()["nodes"]
        if all(len(nodes.get(role, {})) >= n for role, n in expect.items()):
            return
        time.sleep(0.1)
    raise TimeoutError(f"roles {expect} not all registered after {timeout}s")


async def run(args: argparse.Namespace) -> dict[str, object]:
    config = DCSConfig()
    is_actor = args.role == "actor"
    metadata = {"pp_rank": args.pp_rank, "pp_size": args.pp_size, "is_pp_src_rank": True} if is_actor else {}
    state = stage_state(args.pp_rank, 0)
    client = CheckpointEngineClient(
        coordinator_url=config.base_url,
        role=args.role,
        rank=args.rank,
        model=state if args.role == "actor" else None,
        model_name="fwd",
        config=config,
        metadata=metadata,
    )
    await client.start()
    expect = dict(item.split("=") for item in args.expect.split(","))
    await asyncio.to_thread(wait_for_roles, config.base_url, {k: int(v) for k, v in expect.items()})
    results: dict[str, object] = {}
    try:
        if args.fully_async:
            return await run_fully_async(client, args, state)
        if args.back_to_back:
            return await run_back_to_back(client, args, state)
        for rollout_id in range(1, args.rollouts + 1):
            if args.role == "actor":
                state.update(stage_state(args.pp_rank, rollout_id))
                await client.init_process_groups_for_actor_fwd_ref(rollout_id)
                await client.update_weights_for_rollout(actor_fwd_only=True)
                results[str(rollout_id)] = {"version": rollout_id, "digest": digest(state)}
            elif await client.init_process_groups_for_actor_fwd_ref(rollout_id):
                version = await client.recv_weight()
                results[str(rollout_id)] = {"version": version, "digest": digest(client.received_weights)}
    finally:
        await client.stop()
    return results


async def run_fully_async(
    client: CheckpointEngineClient, args: argparse.Namespace, state: dict[str, torch.Tensor]
) -> dict[str, object]:
    """One group (rollout 1); the actor pushes --rollouts updates back to back, the receiver follows them
    with `recv_weight_fully_async()`. Returns the last version and digest."""
    await client.init_process_groups_for_actor_fwd_ref(1)
    if args.role == "actor":
        for update in range(1, args.rollouts + 1):
            state.update(stage_state(args.pp_rank, update))
            await client.update_weights_for_rollout(actor_fwd_only=True)
        return {"version": args.rollouts, "digest": digest(state)}
    if args.slow_log_reads:
        slow_log_reads(client, args.slow_log_reads)
    task = await client.recv_weight_fully_async()
    deadline = time.monotonic() + 60
    while client.weight_version < args.rollouts:
        assert not task.done(), task.exception()
        assert time.monotonic() < deadline, f"stuck at v{client.weight_version}"
        await asyncio.sleep(0.05)
    return {"version": client.weight_version, "digest": digest(client.received_weights)}


async def run_back_to_back(
    client: CheckpointEngineClient, args: argparse.Namespace, state: dict[str, torch.Tensor]
) -> dict[str, object]:
    """One group (rollout 1); each actor pushes --rollouts updates back to back (waiting --update-delay seconds
    before each, so one pp stage can run ahead of another), the receiver calls `recv_weight()` once per update.
    Returns {update: {"version": v, "digest": {...}}} (actor: its stage's tensors; receiver: what it committed)."""
    await client.init_process_groups_for_actor_fwd_ref(1)
    results: dict[str, object] = {}
    if args.role == "actor":
        for update in range(1, args.rollouts + 1):
            await asyncio.sleep(args.update_delay)
            state.update(stage_state(args.pp_rank, update))
            await client.update_weights_for_rollout(actor_fwd_only=True)
            results[str(update)] = {"version": update, "digest": digest(state)}
        return results
    if args.slow_log_reads:
        slow_log_reads(client, args.slow_log_reads)
    for update in range(1, args.rollouts + 1):
        version = await client.recv_weight()
        results[str(update)] = {"version": version, "digest": digest(client.received_weights)}
    return results


def slow_log_reads(client: CheckpointEngineClient, seconds: float) -> None:
    """Every read of the weight-meta log starts `seconds` late: by then the sender has ended one update and
    announced the next one's first bucket, so one answer holds both (the receiver's coordinator client is
    wrapped in this test process; nothing in DCS is told)."""
    api = client._require_api()
    read = api.recv_weight_meta

    async def late_read(*args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(seconds)
        return await read(*args, **kwargs)

    api.recv_weight_meta = late_read  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--role", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--pp-rank", type=int, default=0)
    parser.add_argument("--pp-size", type=int, default=1)
    parser.add_argument("--rollouts", type=int, default=3)
    parser.add_argument("--expect", required=True, help="role=count,... to wait for before the first rollout")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--fully-async", action="store_true")
    parser.add_argument("--back-to-back", action="store_true", help="one group, --rollouts updates in a row")
    parser.add_argument("--update-delay", type=float, default=0.0, help="actor, --back-to-back: wait before each")
    parser.add_argument("--slow-log-reads", type=float, default=0.0, help="actor_fwd: each log read this late")
    args = parser.parse_args()
    args.out.write_text(json.dumps(asyncio.run(run(args))))


if __name__ == "__main__":
    main()
