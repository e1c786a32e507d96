"""The reference rollout receiver: a FastAPI app speaking SGLang's weight-update HTTP API.

Endpoints: POST /init_weights_update_group, POST /update_weights_from_distributed, POST
/destroy_weights_update_group (SGLang's bodies, see `dcs_tasks.sync.models`), GET /weights_digest ->
`WeightsDigest`, GET /get_weight_version, GET /health, GET /metrics (dcs_recv_latency_seconds,
dcs_bytes_received_total per bucket). Blocking collectives run in worker threads so the app keeps answering.
A failed call answers 400 with `{"success": false, "message": ...}`, as SGLang does.
"""

from __future__ import annotations

import asyncio
import logging
import time

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from dcs_tasks.backends.base import GroupSpec
from dcs_tasks.backends.fusion import FusionLayout
from dcs_tasks.errors import DCSError
from dcs_tasks.metrics import get_metrics
from dcs_tasks.receiver.weights import WeightReceiver
from dcs_tasks.sync.gcpause import paused_gc
from dcs_tasks.sync.models import (
    DCS_FUSED_FORMAT,
    DestroyWeightsUpdateGroupRequest,
    EngineResponse,
    InitWeightsUpdateGroupRequest,
    UpdateWeightsFromDistributedRequest,
    WeightsDigest,
)

log = logging.getLogger(__name__)


def _failed(message: str) -> JSONResponse:
    return JSONResponse(EngineResponse(success=False, message=message).model_dump(), status_code=400)


def _version(body: UpdateWeightsFromDistributedRequest) -> int | None:
    """The announced version: an integer (SGLang sends it as a string), or None when not named."""
    if body.weight_version is None:
        return None
    try:
        return int(body.weight_version)
    except ValueError:
        raise ValueError(f"weight_version must be an integer, got {body.weight_version!r}") from None


def _receive(receiver: WeightReceiver, body: UpdateWeightsFromDistributedRequest) -> int:
    """Receive every broadcast `body` announces (one, or `bucket_sizes` of them), recording metrics; returns the
    version staged."""
    started = time.perf_counter()
    buckets = body.buckets()
    flattened = body.load_format == DCS_FUSED_FORMAT
    version = receiver.receive_buckets(buckets, body.group_name, _version(body), flattened)
    nbytes = sum(FusionLayout.from_wire(*bucket).payload_bytes for bucket in buckets)
    get_metrics().record_recv(nbytes, time.perf_counter() - started)
    return version


def create_receiver_app(receiver: WeightReceiver, pause_gc: bool = True) -> FastAPI:
    """The app serving one `WeightReceiver` (this process is group rank `rank_offset`); `pause_gc` holds off
    the cyclic garbage collector while an update is received (see `dcs_tasks.sync.gcpause`)."""
    app = FastAPI(title="DCS reference rollout receiver")

    @app.post("/init_weights_update_group", response_model=EngineResponse)
    async def init_group(body: InitWeightsUpdateGroupRequest) -> EngineResponse | JSONResponse:
        spec = GroupSpec(
            body.group_name, body.master_address, body.master_port, body.world_size, body.rank_offset, body.backend
        )
        try:
            await asyncio.to_thread(receiver.init_group, spec)
        except DCSError as exc:
            return _failed(str(exc))
        return EngineResponse(success=True, message=f"joined {body.group_name} as rank {body.rank_offset}")

    @app.post("/update_weights_from_distributed", response_model=EngineResponse)
    async def update(body: UpdateWeightsFromDistributedRequest) -> EngineResponse | JSONResponse:
        try:
            with paused_gc(pause_gc):
                version = await asyncio.to_thread(_receive, receiver, body)
                if body.flush_cache:
                    receiver.commit(version)
            if body.flush_cache:
                log.info("committed v%d", version)
        except (DCSError, ValueError) as exc:
            get_metrics().record_error(type(exc).__name__)
            log.warning("update failed: %s", exc)
            return _failed(str(exc))
        return EngineResponse(success=True, message=f"received {len(body.names)} tensors")

    @app.post("/destroy_weights_update_group", response_model=EngineResponse)
    async def destroy(body: DestroyWeightsUpdateGroupRequest) -> EngineResponse:
        await asyncio.to_thread(receiver.destroy_group, body.group_name)
        return EngineResponse(success=True, message=f"destroyed {body.group_name}")

    @app.get("/weights_digest", response_model=WeightsDigest)
    async def weights_digest() -> WeightsDigest:
        version, tensors = await asyncio.to_thread(receiver.digest)
        return WeightsDigest(weight_version=version, tensors=tensors)

    @app.get("/get_weight_version")
    async def get_weight_version() -> dict[str, int]:
        """The committed version (cheap; /weights_digest also hashes every tensor)."""
        return {"weight_version": receiver.weight_version}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(get_metrics().export_prometheus(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return app
