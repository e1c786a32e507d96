"""The weight-meta log: append, long-poll read by index (bounded answers), clear."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, HTTPException, Query, Response

from coordinator.deps import ServicesDep, WeightMetaDep
from coordinator.responses import COMMON, errors
from dcs_tasks.jsonbody import StrictJSONRoute
from dcs_tasks.models import MAX_INDEX, ClearWeightMetaResponse, StatusResponse, WeightMeta, WeightMetaBatch

router = APIRouter(tags=["weight-meta"], route_class=StrictJSONRoute)

MAX_WAIT_S = 300.0
MAX_LIMIT = 100_000

IdempotencyKey = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key",
        pattern=r"^[A-Za-z0-9_-]{8,128}$",
        description="one value for every attempt of one append (8-128 of A-Z a-z 0-9 _ -): a repeat within "
        "60 s is not appended again",
    ),
]


@router.post("/send_weight_meta", response_model=StatusResponse, responses=errors(*COMMON, 400, 413))
async def send_weight_meta(
    body: WeightMeta, services: ServicesDep, idempotency_key: IdempotencyKey = None
) -> StatusResponse:
    """Append one entry; 413 when its JSON is over DCS_WEIGHT_META_ENTRY_MAX_BYTES. With `Idempotency-Key`,
    a retry of the same append (its first answer lost) answers the same index and appends nothing."""
    entry = body.model_dump_json(exclude_none=True)  # an unversioned entry is stored as older releases wrote it
    limit = services.config.coordinator.weight_meta_entry_max_bytes
    if len(entry.encode()) > limit:
        detail = (
            f"weight-meta entry is {len(entry.encode())} bytes of JSON; the limit is {limit} bytes "
            "(DCS_WEIGHT_META_ENTRY_MAX_BYTES): split the bucket"
        )
        raise HTTPException(status_code=413, detail=detail)
    length = await services.weight_meta.append(entry, append_id=idempotency_key)
    return StatusResponse(message=f"appended entry {length - 1}")


@router.get("/recv_weight_meta", response_model=WeightMetaBatch, responses=errors(*COMMON))
async def recv_weight_meta(
    store: WeightMetaDep,
    index: Annotated[int, Query(ge=0, le=MAX_INDEX, description="first entry wanted (absolute index)")] = 0,
    wait_timeout_s: Annotated[float, Query(ge=0, le=MAX_WAIT_S, description="long-poll bound, seconds")] = 0.0,
    limit: Annotated[
        int | None, Query(ge=0, le=MAX_LIMIT, description="most entries wanted (0: only the indices)")
    ] = None,
) -> Response:
    """Entries from `index`; when none exist yet, waits (pub/sub, no polling) up to `wait_timeout_s`.

    One answer carries at most DCS_WEIGHT_META_READ_MAX_ENTRIES entries and DCS_WEIGHT_META_READ_MAX_BYTES
    bytes of them (and at most `limit`): while `next_index < end_index`, read again from `next_index`.
    """
    # The body is a WeightMetaBatch encoded once for every request of this process sharing the read (300
    # long-polls woken by one append), so FastAPI does not re-validate and re-encode it per request.
    answer = await store.wait_answer(index, wait_timeout_s, limit)
    return Response(content=answer.body, media_type="application/json")


@router.post("/clear_weight_meta", response_model=ClearWeightMetaResponse, responses=errors(*COMMON))
async def clear_weight_meta(store: WeightMetaDep) -> ClearWeightMetaResponse:
    """Empty the log (indices keep counting)."""
    cleared = await store.clear()
    return ClearWeightMetaResponse(message=f"cleared {cleared} entries", cleared=cleared)


@router.get(
    "/clear_weight_meta",
    response_model=ClearWeightMetaResponse,
    responses=errors(*COMMON),
    operation_id="clear_weight_meta_get",
)
async def clear_weight_meta_get(store: WeightMetaDep) -> ClearWeightMetaResponse:
    """The original design's GET form of POST /clear_weight_meta, kept for scripts (docs/seed_compat.md). It
    changes state, so it needs the token when one is set, and without a token it refuses cross-site browser
    requests (403); prefer POST."""
    return await clear_weight_meta(store)
