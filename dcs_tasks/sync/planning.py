"""Rank maths of the rollout update group, and the contract between rollout registrations and the trainer.

Registration contract (what anything that registers a rollout engine must provide, e.g. `dcs receiver`
or `dcs engine attach` for a real SGLang server):

- role `rollout` (or the trainer's `rollout_role`), `rank` = the engine's rollout rank (it orders the
  engines' rank offsets in the group), `ip` / `port` = the engine's SGLang HTTP API as the trainer's host
  reaches it (the trainer and the `dcs worker` of its host call it directly).
- The engine serves SGLang's weight-update API on that address and accepts `Authorization: Bearer
  <DCS_AUTH_TOKEN>` (SGLang's `--api-key`), or no key when DCS has none: the trainer sends the DCS token
  on every call.
- `metadata["instance"]`: a token new for every engine process (`dcs receiver` makes one at start, `dcs
  engine attach` one per registration, and a new registration whenever its engine stopped answering and
  answers again). The trainer reuses a formed group only while every engine's (rank, ip, port, instance) is
  unchanged, so an engine restarted at the same address gets a new group before any bucket is sent, instead
  of failing the first update after its restart. Without one (""), only the address is compared. A value
  that is not a string of up to 64 characters `[A-Za-z0-9_.-]` is ignored.
- `metadata["engine"]`: "vllm" for a vLLM server (its RL API, `dcs_tasks.sync.vllm_protocol`); absent or
  anything else means SGLang's weight-update API.
- Other `metadata` is NOT read by the planner. The rank span, version and capabilities come from the engine
  itself: once per group formation the trainer reads `GET /server_info` (`version`, `tp_size`,
  `dp_size`, `pp_size`), see `dcs_tasks.sync.engine_protocol`. Metadata keys such as `num_gpus` or
  `load_formats` are ignored (they may stay for operators to read).

Plan: engines sorted by rank; engine i joins with `rank_offset` = 1 + the tp_size of the engines before it
(SGLang's TP rank r joins as `rank_offset + r`); world size = 1 + sum of tp sizes; the trainer is rank 0.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterable, Mapping

from dcs_tasks.config import RoleInfo
from dcs_tasks.sync.wire import (
    INSTANCE_MAX_LENGTH,
    INSTANCE_PATTERN,
    EngineEndpoint,
    EngineInfo,
    EngineKind,
    GroupPlan,
)


def endpoint_of(node: RoleInfo) -> EngineEndpoint:
    """A registered rollout node's address (rank offset and engine facts are filled in by `plan_rollout_group`)."""
    if node.rank is None:
        raise ValueError(f"rollout node at {node.address} has no rank")
    return EngineEndpoint(rank=node.rank, ip=node.ip, port=node.port, instance=instance_of(node), kind=kind_of(node))


def kind_of(node: RoleInfo) -> EngineKind:
    """The registration's engine family (`metadata["engine"]`, written by `dcs engine attach --kind`): "vllm"
    speaks vLLM's RL API; anything else (none, "sglang", a `dcs receiver`) SGLang's weight-update API."""
    return "vllm" if node.metadata.get("engine") == "vllm" else "sglang"


def instance_of(node: RoleInfo) -> str:
    """The registration's instance token, or "" when it has none or a malformed one (a Redis record is hostile
    input: a bad token must not stop updates, it only hides a restart as before tokens existed)."""
    token = node.metadata.get("instance")
    if isinstance(token, str) and len(token) <= INSTANCE_MAX_LENGTH and re.fullmatch(INSTANCE_PATTERN, token):
        return token
    return ""


def new_instance() -> str:
    """A fresh instance token for a registration's metadata."""
    return uuid.uuid4().hex


def plan_rollout_group(engines: Iterable[EngineEndpoint], infos: Mapping[str, EngineInfo]) -> GroupPlan:
    """World size = 1 + sum of tp sizes; rank offsets are cumulative in engine-rank order, starting at 1.
    `infos` maps each engine's `node_id` to what its `/server_info` said."""
    planned: list[EngineEndpoint] = []
    offset = 1
    for engine in sorted(engines, key=lambda e: e.rank):
        info = infos[engine.node_id]
        planned.append(engine.model_copy(update={"rank_offset": offset, "info": info}))
        offset += info.tp_size
    return GroupPlan(world_size=offset, engines=tuple(planned))
