"""Operator endpoints: process liveness and Prometheus metrics (both public even with a token)."""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST

from coordinator.deps import ServicesDep
from dcs_tasks.jsonbody import StrictJSONRoute
from dcs_tasks.metrics import get_metrics
from dcs_tasks.models import StatusResponse

router = APIRouter(tags=["ops"], route_class=StrictJSONRoute)


@router.get("/healthz", response_model=StatusResponse)
async def healthz() -> StatusResponse:
    """The process serves HTTP; says nothing about Redis (see /health)."""
    return StatusResponse(message="coordinator up")


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}}}},
)
async def metrics(services: ServicesDep) -> Response:
    """Prometheus text: the coordinator's request metrics and this process's `get_metrics()` collector.

    With PROMETHEUS_MULTIPROC_DIR set (before start), the aggregate of every process writing to that
    directory instead (coordinator workers, and DCS processes of this host sharing it), each family once.
    """
    body = get_metrics().export_prometheus(services.request_metrics.registry)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
