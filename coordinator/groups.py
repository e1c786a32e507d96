"""Pure rank maths of the control plane: role order, global ranks, the actor -> actor_fwd/reference group.

No I/O here: callers pass what they read from the topology, so every rule is unit-testable.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from dcs_tasks.config import RoleInfo
from dcs_tasks.models import GroupRanksResponse

ACTOR = "actor"
ACTOR_FWD = "actor_fwd"
REFERENCE = "reference"


class GroupRoleError(ValueError):
    """The role has no place in the model-update group (the coordinator answers 400)."""


def role_order(configured: Iterable[str] | None, registered: Iterable[str]) -> list[str]:
    """Roles in global-rank order: the configured order first, then the others in first-registration order."""
    order = list(dict.fromkeys(configured or ()))
    order.extend(role for role in registered if role not in order)
    return order


def rank_span(live_ranks: Iterable[int]) -> int:
    """The size of a role in the global rank space: its highest live rank + 1 (0 when none is alive).

    With dense ranks 0..n-1 (the usual case: a missing rank gets the smallest free one) this is the live
    count n. When a dead node leaves a gap below the highest live rank, the gap keeps its slot, so the
    global ranks of the live nodes stay distinct and do not shift; a counted size would make them collide.
    """
    return max(live_ranks, default=-1) + 1


def global_rank(order: list[str], spans: Mapping[str, int], role: str, rank: int) -> int:
    """Sum of the rank spans (`rank_span`) of the roles before `role` in `order`, plus `rank`.

    Distinct for every live node of the roles in `order`, and below the sum of all spans.
    Raises KeyError when `role` is not in `order`.
    """
    if role not in order:
        raise KeyError(role)
    before = order[: order.index(role)]
    return sum(spans.get(r, 0) for r in before) + rank


def _meta_int(meta: Mapping[str, Any], key: str, default: int, node: str) -> int:
    value = meta.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise GroupRoleError(f"{node}: metadata {key!r} must be a non-negative integer, got {value!r}")
    return value


def pp_groups(actors: Mapping[int, RoleInfo]) -> dict[str, str]:
    """`update_actor_pp_{pp_rank}` -> `tcp://{master_address}:{master_port}` of every actor marked `is_pp_src_rank`.

    `master_address` defaults to the actor's ip; `master_port` is required for a source rank.
    """
    groups: dict[str, str] = {}
    for rank in sorted(actors):
        node = actors[rank]
        meta = node.metadata
        if not meta.get("is_pp_src_rank"):
            continue
        pp_rank = _meta_int(meta, "pp_rank", 0, node.node_id)
        if "master_port" not in meta:
            raise GroupRoleError(f"{node.node_id} is a pp source rank but its metadata has no 'master_port'")
        port = _meta_int(meta, "master_port", 0, node.node_id)
        address = str(meta.get("master_address") or node.ip)
        groups[f"update_actor_pp_{pp_rank}"] = f"tcp://{address}:{port}"
    return groups


def model_update_group_ranks(
    role: str,
    rank: int,
    need_update_ref: bool,
    *,
    num_actor_fwd: int,
    num_reference: int,
    actors: Mapping[int, RoleInfo],
) -> GroupRanksResponse:
    """Global rank and size of the group an actor broadcasts updated weights in.

    actor -> 0; actor_fwd -> 1 + rank; reference -> 1 + num_actor_fwd + rank. world_size = 1 + num_actor_fwd
    (+ num_reference when `need_update_ref`). The counts are rank spans (`rank_span`: highest live rank + 1,
    the live count when ranks are dense), so a dead node's gap never gives two members one group rank; the
    group then waits for that slot and its init times out until a replacement takes the rank.
    `train_pp_size` is actor rank 0's metadata `pp_size` (default 1).
    Raises GroupRoleError for any other role, or a reference node when `need_update_ref` is false.
    """
    if role == ACTOR:
        group_rank = 0
    elif role == ACTOR_FWD:
        group_rank = 1 + rank
    elif role == REFERENCE:
        if not need_update_ref:
            raise GroupRoleError("a reference node is only in the update group when need_update_ref is true")
        group_rank = 1 + num_actor_fwd + rank
    else:
        raise GroupRoleError(
            f"role {role!r} takes no part in the model-update group; use actor, actor_fwd or reference"
        )
    world_size = 1 + num_actor_fwd + (num_reference if need_update_ref else 0)
    actor0 = actors.get(0)
    pp_size = _meta_int(actor0.metadata, "pp_size", 1, actor0.node_id) if actor0 else 1
    return GroupRanksResponse(
        global_rank=group_rank, world_size=world_size, train_pp_size=max(pp_size, 1), pp_groups=pp_groups(actors)
    )
