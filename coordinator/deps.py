"""FastAPI dependencies as `Annotated` aliases: the per-app services live on `app.state.services`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import redis.asyncio as aioredis
from fastapi import Depends, Query, Request

from coordinator.middleware import RequestMetrics
from coordinator.topology import TopologyManager
from coordinator.weight_meta import WeightMetaStore
from dcs_tasks.config import DCSConfig
from dcs_tasks.models import MAX_RANK

ROLE_PATTERN = r"^[A-Za-z0-9_.\-]+$"


@dataclass
class Services:
    """Everything a request handler needs, built once per app in its lifespan."""

    config: DCSConfig
    redis: aioredis.Redis
    topology: TopologyManager
    weight_meta: WeightMetaStore
    request_metrics: RequestMetrics


# `async def` on purpose: FastAPI runs plain `def` dependencies in a worker thread, which costs more than
# the whole heartbeat's Redis round trip.
async def get_services(request: Request) -> Services:
    services: Services = request.app.state.services
    return services


async def get_topology(request: Request) -> TopologyManager:
    services: Services = request.app.state.services
    return services.topology


async def get_weight_meta(request: Request) -> WeightMetaStore:
    services: Services = request.app.state.services
    return services.weight_meta


ServicesDep = Annotated[Services, Depends(get_services)]
TopologyDep = Annotated[TopologyManager, Depends(get_topology)]
WeightMetaDep = Annotated[WeightMetaStore, Depends(get_weight_meta)]
RoleQuery = Annotated[str, Query(min_length=1, max_length=64, pattern=ROLE_PATTERN, description="role name")]
RankQuery = Annotated[int, Query(ge=0, le=MAX_RANK, description="rank inside the role")]
