"""The weight-meta log: append, long-poll read by index, clear."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from coordinator.deps import WeightMetaDep
from dcs_tasks.models import ClearWeightMetaResponse, StatusResponse, WeightMeta, WeightMetaBatch

router = APIRouter(tags=["weight-meta"])

MAX_WAIT_S = 300.0


@router.post("/send_weight_meta", response_model=StatusResponse)
async def send_weight_meta(body: WeightMeta, store: WeightMetaDep) -> StatusResponse:
    length = await store.append(body)
    return StatusResponse(message=f"appended entry {length - 1}")


@router.get("/recv_weight_meta", response_model=WeightMetaBatch)
async def recv_weight_meta(
    store: WeightMetaDep,
    index: Annotated[int, Query(ge=0, description="first entry wanted")] = 0,
    wait_timeout_s: Annotated[float, Query(ge=0, le=MAX_WAIT_S, description="long-poll bound, seconds")] = 0.0,
) -> WeightMetaBatch:
    """Entries from `index`; when none exist yet, waits (pub/sub, no polling) up to `wait_timeout_s`."""
    return await store.wait_read(index, wait_timeout_s)


@router.get("/clear_weight_meta", response_model=ClearWeightMetaResponse)
async def clear_weight_meta(store: WeightMetaDep) -> ClearWeightMetaResponse:
    cleared = await store.clear()
    return ClearWeightMetaResponse(message=f"cleared {cleared} entries", cleared=cleared)
