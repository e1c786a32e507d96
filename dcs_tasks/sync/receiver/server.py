"""The reference rollout receiver: a FastAPI app that answers on the wire exactly like SGLang 0.5.23.

SGLang's routes, bodies, status codes and error shapes (sglang/srt/entrypoints/http_server.py): POST
/init_weights_update_group, /destroy_weights_update_group, /begin_weight_update, /end_weight_update,
/update_weights_from_distributed (only inside a begin/end session, else 400), /pause_generation,
/continue_generation; GET /server_info (and the deprecated /get_server_info), /model_info (`weight_version`,
`"default"` before any update), /get_weights_by_name (GET or POST), /health (empty 200). A failed call
answers 400 with `{"success": false, "message": ...}`; a body that does not validate, 400 with SGLang's
`{"object": "error", "message", "type": "Bad Request", "param": null, "code": 400}` (not FastAPI's 422).
Read-only debug routes SGLang lacks, which the trainer never calls: GET /weights_digest -> `WeightsDigest`,
GET /metrics (dcs_recv_latency_seconds, dcs_bytes_received_total per bucket).

Where it differs from SGLang, by design: SGLang loads each bucket into its live weights; this receiver
stages buckets and swaps them in only when the bucket with `flush_cache=true` arrives (the trainer's last),
so it never holds a partial update: ending a session drops whatever was staged but not committed. Weight
versions must be integers. Blocking collectives run in worker threads so the app keeps answering.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from dcs_tasks.backends.base import GroupSpec
from dcs_tasks.backends.fusion import ALIGNMENT, SGLANG_ALIGNMENT, FusionLayout
from dcs_tasks.errors import DCSError
from dcs_tasks.jsonbody import StrictJSONRoute
from dcs_tasks.metrics import get_metrics
from dcs_tasks.sync.colocated_receive import add_frame_route
from dcs_tasks.sync.engine_protocol import SUPPORTED_VERSIONS
from dcs_tasks.sync.gcpause import paused_gc
from dcs_tasks.sync.receiving import WeightReceiver
from dcs_tasks.sync.wire import (
    SGLANG_FLAT_FORMAT,
    DestroyWeightsUpdateGroupRequest,
    EngineResponse,
    GetWeightsByNameRequest,
    InitWeightsUpdateGroupRequest,
    UpdateWeightsFromDistributedRequest,
    WeightsDigest,
)

log = logging.getLogger(__name__)

SGLANG_VERSION = SUPPORTED_VERSIONS[-1]
"""The SGLang version this receiver answers as (its `/server_info` `version`)."""
MODEL_PATH = "dcs-receiver"
OUTSIDE_SESSION = "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"


def _answer(success: bool, message: str) -> JSONResponse:
    """SGLang's answer to weight-update calls: 200 on success, 400 with the same shape on failure."""
    return JSONResponse(EngineResponse(success=success, message=message).model_dump(), 200 if success else 400)


async def _invalid(request: Request, exc: Exception) -> JSONResponse:
    """SGLang's answer to a body that does not validate: 400 with its OpenAI-style `ErrorResponse` (its
    `validation_exception_handler` overrides FastAPI's 422), message built the same way."""
    assert isinstance(exc, RequestValidationError)
    exc_str, errors_str = str(exc), str(exc.errors())
    message = f"{exc_str} {errors_str}" if errors_str and errors_str != exc_str else exc_str
    body = {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}
    return JSONResponse(body, status_code=400)


def _version(body: UpdateWeightsFromDistributedRequest) -> int | None:
    """The announced version: an integer (SGLang sends it as a string), or None when not named."""
    if body.weight_version is None:
        return None
    try:
        return int(body.weight_version)
    except ValueError:
        raise ValueError(f"weight_version must be an integer, got {body.weight_version!r}") from None


def _receive(receiver: WeightReceiver, body: UpdateWeightsFromDistributedRequest) -> int:
    """Receive the bucket `body` announces (one flat broadcast in SGLang's layout, or one per tensor), recording
    metrics, and commit the update when `body` is its last bucket (`flush_cache`; in the same worker-thread
    call: one thread hand-off less before the answer); returns the version staged."""
    started = time.perf_counter()
    flattened = body.load_format == SGLANG_FLAT_FORMAT
    if body.load_format not in (None, SGLANG_FLAT_FORMAT):
        raise ValueError(f"Unknown load_format={body.load_format}")
    bucket = (body.names, body.dtypes, body.shapes)
    version = receiver.receive_bucket(*bucket, body.group_name, _version(body), flattened, SGLANG_ALIGNMENT)
    nbytes = FusionLayout.from_wire(*bucket, ALIGNMENT).payload_bytes
    get_metrics().record_recv(nbytes, time.perf_counter() - started)
    if body.flush_cache:
        receiver.commit(version)
    return version


_INVALID_BODY: dict[str, Any] = {  # `_invalid`'s answer (SGLang's ErrorResponse)
    "type": "object",
    "properties": {"object": {"type": "string"}, "message": {"type": "string"}, "code": {"type": "integer"}},
    "required": ["object", "message", "code"],
}
_UNKNOWN_WEIGHT: dict[str, Any] = {  # 400s of /get_weights_by_name: no such weight (SGLang's), bad body, not JSON
    "description": "No weight of that name, or a body that does not validate",
    "content": {
        "application/json": {
            "schema": {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {"error": {"type": "object", "properties": {"message": {"type": "string"}}}},
                        "required": ["error"],
                    },
                    _INVALID_BODY,
                    {"type": "object", "properties": {"detail": {"type": "string"}}, "required": ["detail"]},
                ]
            }
        }
    },
}


class EngineState:
    """SGLang's control state as this receiver mirrors it: the weight-update session and the pause flag."""

    def __init__(self) -> None:
        self.session = False
        self.paused = False


def create_receiver_app(receiver: WeightReceiver, pause_gc: bool = True) -> FastAPI:
    """The app serving one `WeightReceiver` (this process is group rank `rank_offset`, tp_size 1); `pause_gc`
    holds off the cyclic garbage collector while an update is received (see `dcs_tasks.sync.gcpause`)."""
    app = FastAPI(title="DCS reference rollout receiver")
    app.router.route_class = StrictJSONRoute  # a lone surrogate in a body is an invalid body (dcs_tasks.jsonbody)
    app.add_exception_handler(RequestValidationError, _invalid)
    state = EngineState()
    _group_routes(app, receiver)
    _session_routes(app, receiver, state)
    _update_route(app, receiver, state, pause_gc)
    add_frame_route(app, receiver, lambda: state.session)  # colocated updates (dcs_tasks/sync/colocated_receive.py)
    _info_routes(app, receiver, state)
    return app


def _group_routes(app: FastAPI, receiver: WeightReceiver) -> None:
    @app.post("/init_weights_update_group", response_model=EngineResponse)
    async def init_group(body: InitWeightsUpdateGroupRequest) -> JSONResponse:
        spec = GroupSpec(
            body.group_name, body.master_address, body.master_port, body.world_size, body.rank_offset, body.backend
        )
        try:
            await asyncio.to_thread(receiver.init_group, spec)
        except DCSError as exc:
            return _answer(False, f"Failed to initialize custom process group: {exc}.")
        return _answer(True, "Succeeded to initialize custom process group.")

    @app.post("/destroy_weights_update_group", response_model=EngineResponse)
    async def destroy(body: DestroyWeightsUpdateGroupRequest) -> JSONResponse:
        if receiver.group_name != body.group_name:
            return _answer(False, "The group to be destroyed does not exist.")
        await asyncio.to_thread(receiver.destroy_group, body.group_name)
        return _answer(True, "Succeeded to destroy custom process group.")


def _session_routes(app: FastAPI, receiver: WeightReceiver, state: EngineState) -> None:
    @app.post("/begin_weight_update", response_model=EngineResponse)
    async def begin(request: Request) -> JSONResponse:
        if state.session:
            return _answer(False, "a weight-update session is already open; call end_weight_update() first")
        receiver.abort()  # nothing staged survives from before the session (inline: its lock is never held long)
        state.session = True
        return _answer(True, "Success")

    @app.post("/end_weight_update", response_model=EngineResponse)
    async def end(request: Request) -> JSONResponse:
        if not state.session:
            return _answer(False, "no weight-update session is open; call begin_weight_update() first")
        receiver.abort()  # a partial update (no final bucket) is dropped, never served
        state.session = False
        return _answer(True, "Success")

    @app.post("/pause_generation")
    async def pause(request: Request) -> JSONResponse:
        state.paused = True
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    @app.post("/continue_generation")
    async def resume(request: Request) -> JSONResponse:
        state.paused = False
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})


def _update_route(app: FastAPI, receiver: WeightReceiver, state: EngineState, pause_gc: bool) -> None:
    @app.post("/update_weights_from_distributed", response_model=EngineResponse)
    async def update(body: UpdateWeightsFromDistributedRequest) -> JSONResponse:
        if not state.session:
            return _answer(False, OUTSIDE_SESSION)
        try:
            with paused_gc(pause_gc):
                version = await asyncio.to_thread(_receive, receiver, body)
        except (DCSError, ValueError) as exc:
            get_metrics().record_error(type(exc).__name__)
            log.warning("update failed: %s", exc)
            return _answer(False, f"Failed to receive weights: {exc}")
        if body.flush_cache:
            log.info("committed v%d", version)
        message = "Succeeded to update parameter online."
        if body.weight_version is not None:
            message += f" Weight version updated to {body.weight_version}."
        return _answer(True, message)


def _info_routes(app: FastAPI, receiver: WeightReceiver, state: EngineState) -> None:
    started = time.time()

    @app.get("/model_info")
    async def model_info() -> dict[str, Any]:
        version = receiver.weight_version
        return {
            "model_path": MODEL_PATH,
            "served_model_name": MODEL_PATH,
            "tokenizer_path": None,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": str(version) if version else "default",
            "load_format": "auto",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": None,
            "architectures": None,
        }

    async def server_info() -> dict[str, Any]:
        return {
            "model_path": MODEL_PATH,
            "tp_size": 1,
            "dp_size": 1,
            "pp_size": 1,
            "launch_command": "dcs receiver",
            "startup_time": started,
            "internal_states": [{"paused": state.paused}],
            "version": SGLANG_VERSION,
            "frontend": "python",
        }

    app.get("/server_info")(server_info)
    app.get("/get_server_info")(server_info)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"], responses={400: _UNKNOWN_WEIGHT})
    async def get_weights_by_name(body: GetWeightsByNameRequest) -> JSONResponse:
        tensor = receiver.weights.get(body.name)
        if tensor is None:
            return JSONResponse({"error": {"message": "Get parameter by name failed"}}, status_code=400)
        return JSONResponse(tensor.float().tolist()[: body.truncate_size])

    @app.get("/weights_digest", response_model=WeightsDigest)
    async def weights_digest() -> WeightsDigest:
        version, tensors = await asyncio.to_thread(receiver.digest)
        return WeightsDigest(weight_version=version, tensors=tensors)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(get_metrics().export_prometheus(), media_type=CONTENT_TYPE_LATEST)
