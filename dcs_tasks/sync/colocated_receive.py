"""`dcs receiver`'s side of a colocated update: `POST /update_weights_from_ipc_frame`.

The body is DCS's frame (`dcs_tasks/sync/ipcframe.py`: JSON, fixed fields, never unpickled). The receiver opens
the bucket it names (shared memory read-only, or the trainer's CUDA memory by IPC handle), copies the bucket
into its own staging buffer and closes the handle before it answers: the answer is the trainer's release.
Staging and commit are the same as for a broadcast bucket (`WeightReceiver`): the bucket with `last` commits
its version; a session must be open (`/begin_weight_update`), as for `/update_weights_from_distributed`.
Answers are SGLang's shape (`{"success", "message"}`, 200 or 400).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from dcs_tasks.errors import DCSError, WeightSyncError
from dcs_tasks.metrics import get_metrics
from dcs_tasks.sync.colocated import FRAME_ROUTE
from dcs_tasks.sync.ipcframe import MAX_FRAME_BYTES, IpcFrame, IpcFrameInvalid, from_json, open_bucket
from dcs_tasks.sync.receive_checks import check_tensors
from dcs_tasks.sync.receiving import WeightReceiver
from dcs_tasks.sync.wire import EngineResponse


def stage_frame(receiver: WeightReceiver, frame: IpcFrame) -> int:
    """Copy the bucket `frame` names into `receiver`'s staging for its version (committing it when `last`);
    returns the version. Raises IpcFrameInvalid / WeightSyncError."""
    layout = frame.layout()
    nbytes = check_tensors(frame.names, frame.dtypes, [list(s) for s in frame.shapes], receiver.max_update_bytes)
    with receiver._lock:
        version = receiver._start_staging(frame.weight_version)
        receiver._reserve(nbytes, version)
        epoch = receiver._epoch
        buffer = receiver._take_buffer(layout.total_bytes)
    view = buffer[: layout.wire_bytes]
    with open_bucket(frame) as shared:
        view.copy_(shared)  # the one copy: the trainer's bucket into this receiver's own memory
        if shared.device.type == "cuda":
            torch.cuda.current_stream(shared.device).synchronize()
    staged: dict[str, torch.Tensor] = {}
    for spec, offset in zip(layout.specs, layout.offsets, strict=True):
        staged[spec.name] = view[offset : offset + spec.nbytes].view(spec.torch_dtype).view(spec.shape)
    with receiver._lock:
        if receiver._epoch != epoch:
            raise WeightSyncError(f"bucket of v{version} arrived after its update was abandoned; dropped")
        receiver._staging.update(staged)
    if frame.last:
        receiver.commit(version)
    return version


def add_frame_route(app: FastAPI, receiver: WeightReceiver, in_session: Any) -> None:
    """Serve `POST /update_weights_from_ipc_frame` on `app`; `in_session()` says whether a weight-update session
    is open."""

    @app.post(FRAME_ROUTE, response_model=EngineResponse)
    async def update_from_frame(request: Request) -> JSONResponse:
        def answer(success: bool, message: str) -> JSONResponse:
            return JSONResponse(EngineResponse(success=success, message=message).model_dump(), 200 if success else 400)

        if not in_session():
            return answer(False, f"{FRAME_ROUTE[1:]} must run between begin_weight_update() and end_weight_update()")
        raw = await request.body()
        started = time.perf_counter()
        try:
            if len(raw) > MAX_FRAME_BYTES:
                raise IpcFrameInvalid(f"frame of {len(raw)} bytes is over {MAX_FRAME_BYTES}")
            try:
                body = json.loads(raw)
            except ValueError as exc:
                raise IpcFrameInvalid(f"frame is not JSON: {exc}") from None
            frame = from_json(body)
            version = await asyncio.to_thread(stage_frame, receiver, frame)
        except (DCSError, ValueError, RuntimeError) as exc:
            get_metrics().record_error(type(exc).__name__)
            return answer(False, f"Failed to receive weights: {exc}")
        get_metrics().record_recv(frame.nbytes, time.perf_counter() - started)
        message = "Succeeded to update parameter online."
        if frame.last:
            message += f" Weight version updated to {version}."
        return answer(True, message)
