"""Pure rank maths of the rollout update group (DESIGN.md, "Reference semantics")."""

from __future__ import annotations

from collections.abc import Iterable

from dcs_tasks.config import RoleInfo
from dcs_tasks.sync.models import DCS_FUSED_FORMAT, EngineEndpoint, GroupPlan


def engine_of(node: RoleInfo, rank_offset: int = 1) -> EngineEndpoint:
    """A registered rollout node as a group member (`metadata["num_gpus"]`, default 1; flat buckets only if
    `metadata["load_formats"]` lists `dcs_fused_u8_v1`, as `dcs receiver` registers)."""
    if node.rank is None:
        raise ValueError(f"rollout node at {node.address} has no rank")
    gpus = int(node.metadata.get("num_gpus", 1))
    flat = DCS_FUSED_FORMAT in node.metadata.get("load_formats", ())
    return EngineEndpoint(
        rank=node.rank, ip=node.ip, port=node.port, num_gpus=gpus, rank_offset=rank_offset, flattened=flat
    )


def plan_rollout_group(nodes: Iterable[RoleInfo]) -> GroupPlan:
    """World size = 1 + sum of GPUs; rank offsets are cumulative in engine-rank order, starting at 1."""
    ordered = sorted(nodes, key=lambda n: n.rank if n.rank is not None else -1)
    engines: list[EngineEndpoint] = []
    offset = 1
    for node in ordered:
        engine = engine_of(node, offset)
        engines.append(engine)
        offset += engine.num_gpus
    return GroupPlan(world_size=offset, engines=tuple(engines))
