"""Cluster-wide views: topology, global ranks, the model-update group, health and debug."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, HTTPException, Query

from coordinator import groups
from coordinator.deps import ROLE_PATTERN, RankQuery, RoleQuery, ServicesDep, TopologyDep
from coordinator.responses import COMMON, errors
from coordinator.routes.nodes import not_found
from dcs_tasks.jsonbody import StrictJSONRoute
from dcs_tasks.models import (
    DebugTopologyResponse,
    GlobalRankResponse,
    GroupRanksResponse,
    HealthResponse,
    HealthStatus,
    NodeView,
    TopologyResponse,
)

router = APIRouter(tags=["topology"], route_class=StrictJSONRoute)


@router.get("/topology", response_model=TopologyResponse, responses=errors(*COMMON))
async def topology(
    topo: TopologyDep,
    role_filter: Annotated[str | None, Query(min_length=1, max_length=64, pattern=ROLE_PATTERN)] = None,
) -> TopologyResponse:
    """Live nodes by role (only `role_filter` when given); dead nodes are left out.

    `world_size` counts the live nodes returned; `rank_space` sums their roles' rank spans (highest live
    rank + 1): the two are equal unless a dead node leaves a gap below a live rank (see /global_rank).
    """
    snap = await topo.snapshot(None if role_filter is None else [role_filter], alive_only=True)
    if role_filter is not None:
        nodes = {role_filter: snap.alive(role_filter)}
    else:
        nodes = snap.alive_by_role()
    return TopologyResponse(
        nodes=nodes,
        world_size=sum(len(n) for n in nodes.values()),
        rank_space=sum(groups.rank_span(n) for n in nodes.values()),
    )


@router.get("/global_rank", response_model=GlobalRankResponse, responses=errors(*COMMON, 404))
async def global_rank(role: RoleQuery, rank: RankQuery, topo: TopologyDep) -> GlobalRankResponse:
    """Global rank of a live node: the rank spans of the roles before `role`, plus `rank`.

    Roles are ordered by config `role_order`, then first registration. A role's span is its highest live
    rank + 1, i.e. its live world size when ranks are dense (0..n-1). A dead node in the middle keeps its
    slot, so live nodes never share a global rank and their global ranks do not shift; every answer is
    below /topology's `rank_space`. 404 when the node is not registered or not alive.
    """
    found = await topo.get_global_rank(role, rank)
    if found is None:
        raise not_found(role, rank)
    return GlobalRankResponse(global_rank=found)


@router.get("/get_model_update_group_ranks", response_model=GroupRanksResponse, responses=errors(*COMMON, 400, 404))
async def model_update_group_ranks(
    role: RoleQuery, rank: RankQuery, topo: TopologyDep, need_update_ref: bool = False
) -> GroupRanksResponse:
    """Rank of this node in the actor -> actor_fwd (+ reference) weight-update group; 400 for other roles.

    The actor_fwd and reference counts are rank spans as in /global_rank (the live counts when ranks are
    dense), so a dead node's gap never makes two members share a group rank.
    """
    snap = await topo.snapshot([groups.ACTOR, groups.ACTOR_FWD, groups.REFERENCE, role], alive_only=True)
    if rank not in snap.alive(role):
        raise not_found(role, rank)
    try:
        return groups.model_update_group_ranks(
            role,
            rank,
            need_update_ref,
            num_actor_fwd=groups.rank_span(snap.alive(groups.ACTOR_FWD)),
            num_reference=groups.rank_span(snap.alive(groups.REFERENCE)),
            actors=snap.alive(groups.ACTOR),
        )
    except groups.GroupRoleError as exc:
        raise HTTPException(status_code=400, detail=str(exc)) from exc


@router.get("/health", response_model=HealthResponse, responses=errors(*COMMON))
async def health(topo: TopologyDep) -> HealthResponse:
    """Live world size, the nodes registered without a heartbeat key (dead), and the stored records that
    could not be read (skipped by every read; `degraded` while any exist: remove or re-register them)."""
    snap = await topo.check_health()
    dead = snap.dead_node_ids()
    return HealthResponse(
        status=HealthStatus.DEGRADED if dead or snap.unreadable else HealthStatus.HEALTHY,
        timestamp=time.time(),
        world_size=snap.world_size(),
        dead_nodes=dead,
        unreadable_records=len(snap.unreadable),
        unreadable_keys=snap.unreadable[:100],
    )


@router.get("/debug/topology", response_model=DebugTopologyResponse, responses=errors(*COMMON))
async def debug_topology(services: ServicesDep) -> DebugTopologyResponse:
    """Every registered node, dead or alive, with its remaining heartbeat TTL."""
    snap = await services.topology.snapshot()
    nodes = {
        role: {
            rank: NodeView(info=r.info, alive=r.alive, heartbeat_ttl_ms=r.ttl_ms) for rank, r in sorted(recs.items())
        }
        for role, recs in snap.nodes.items()
    }
    return DebugTopologyResponse(
        roles=snap.roles,
        role_mappings=services.topology.config.role_mappings,
        nodes=nodes,
        heartbeat_timeout_seconds=services.config.heartbeat.timeout_seconds,
        weight_meta_entries=await services.weight_meta.length(),
    )
