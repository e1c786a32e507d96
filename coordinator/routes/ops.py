"""Operator endpoints: process liveness and Prometheus metrics (both public even with a token)."""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from coordinator.deps import ServicesDep
from dcs_tasks.models import StatusResponse

router = APIRouter(tags=["ops"])


@router.get("/healthz", response_model=StatusResponse)
async def healthz() -> StatusResponse:
    """The process serves HTTP; says nothing about Redis (see /health)."""
    return StatusResponse(message="coordinator up")


@router.get("/metrics")
async def metrics(services: ServicesDep) -> Response:
    """The coordinator's request metrics in Prometheus text format."""
    return Response(generate_latest(services.request_metrics.registry), media_type=CONTENT_TYPE_LATEST)
