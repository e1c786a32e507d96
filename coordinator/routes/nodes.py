"""Node lifecycle: register, unregister, heartbeat, and single-node look-ups."""

from __future__ import annotations

import json
import re
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from coordinator.deps import ROLE_PATTERN, RankQuery, RoleQuery, ServicesDep, TopologyDep
from coordinator.limits import metadata_problem
from coordinator.responses import COMMON, errors
from coordinator.topology import (
    Registration,
    RegistrationKind,
    TopologyManager,
    is_issued_identity,
    node_identity,
)
from dcs_tasks.config import RoleInfo
from dcs_tasks.errors import RankConflict
from dcs_tasks.jsonbody import StrictJSONRoute, read_body
from dcs_tasks.models import (
    MAX_BATCH_NODES,
    MAX_RANK,
    HeartbeatBatchRequest,
    HeartbeatBatchResponse,
    HeartbeatResponse,
    RegisterBatchRequest,
    RegisterBatchResponse,
    RegisterRequest,
    RegisterResponse,
    StatusResponse,
)

router = APIRouter(tags=["nodes"], route_class=StrictJSONRoute)

_MESSAGES = {
    RegistrationKind.EXPLICIT: "registered with the requested rank",
    RegistrationKind.REREGISTERED: "re-registered; rank kept",
    RegistrationKind.ASSIGNED: "registered with the smallest free rank",
}


def not_found(role: str, rank: int, what: str = "node") -> HTTPException:
    return HTTPException(
        status_code=404, detail=f"{what} {role}_{rank} is not registered or not alive; register it first"
    )


NODE_HEADER = b"x-dcs-node"


NODE_HEADER_DOC = {
    "parameters": [
        {
            "name": "X-DCS-Node",
            "in": "header",
            "required": False,
            "schema": {"type": "string", "pattern": r"^(anon:[0-9a-f]{16}|.{1,255}:[0-9]{1,5})$"},
            "description": "the `identity` /register returned (ip:port, or anon:<hex> for a node without a "
            "port): fences the call (409 when another node now holds the rank); without it, it is unfenced",
        }
    ]
}


def caller_identity(request: Request) -> str:
    """The `X-DCS-Node` header of a fenced heartbeat or unregister, or "" when absent and the coordinator does
    not require it (read without FastAPI's per-parameter machinery: the heartbeat is the hottest path).
    Raises 422 when malformed, or absent while DCS_NODE_IDENTITY_REQUIRED."""
    raw = next((v for k, v in request.scope["headers"] if k == NODE_HEADER), None)
    if raw is None:
        if request.app.state.services.topology.identity_required:
            raise HTTPException(status_code=422, detail=IDENTITY_REQUIRED.format(where="header X-DCS-Node"))
        return ""
    return checked_identity(raw.decode("latin-1"), "X-DCS-Node")


IDENTITY_REQUIRED = (
    "{where} is required: the `identity` /register returned for this node (DCS_NODE_IDENTITY_REQUIRED; "
    "set it to false to accept unfenced requests, see docs/operations.md)"
)


def checked_identity(text: str, where: str) -> str:
    """`text` as a fencing identity ('ip:port' with 0 < port < 65536, or an issued 'anon:<hex>'); 422 naming
    `where` otherwise."""
    if is_issued_identity(text):
        return text
    ip, _, port = text.rpartition(":")
    if not ip or not port.isdigit() or not 0 < int(port) < 65536 or len(ip) > 255:
        detail = f"{where} must be the identity /register returned ('ip:port' or 'anon:<hex>'), got {text[:300]!r}"
        raise HTTPException(status_code=422, detail=detail)
    return node_identity(ip, int(port))


@router.get(
    "/heartbeat", response_model=HeartbeatResponse, openapi_extra=NODE_HEADER_DOC, responses=errors(*COMMON, 404, 409)
)
async def heartbeat(role: RoleQuery, rank: RankQuery, request: Request) -> Response:
    """Refresh the node's TTL (a node that had expired comes back alive); 404 when it never registered.

    Fencing: with header `X-DCS-Node: <identity>` (the `identity` /register returned: "ip:port", or an
    issued "anon:<hex>" for a node without a port), 409 when another node now holds the rank (this one was
    presumed dead and replaced). The header is required (422 without it) unless DCS_NODE_IDENTITY_REQUIRED
    is false, when a beat without it is not fenced; `CoordinatorAPI` always sends it for nodes it registered.
    The hot path: declared first (routes match in order), no dependency layer, pre-serialized answer (see
    bench/coordinator_load.py).
    """
    topology: TopologyManager = request.app.state.services.topology
    try:
        beat = await topology.heartbeat(role, rank, caller_identity(request))
    except RankConflict as exc:
        raise HTTPException(status_code=409, detail=str(exc)) from exc
    if beat is None:
        raise not_found(role, rank)
    return Response(HeartbeatResponse(timestamp=beat).model_dump_json(), media_type="application/json")


_ANSWERS = {"1": '"ok"', "0": '"not_found"', "x": '"conflict"'}
# an identity as /register answers it (a canonical port): taken as it is; any other is checked and normalised
_CANONICAL_IDENTITY = re.compile(
    r"anon:[0-9a-f]{16}|[^\n]{1,255}:(?:[1-9][0-9]{0,3}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5])"
)


def _inline_schema(model: type[BaseModel]) -> dict[str, Any]:
    """`model`'s JSON schema with its `$defs` inlined (an OpenAPI requestBody cannot point into them)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return inline(defs[ref.removeprefix("#/$defs/")])
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    inlined: dict[str, Any] = inline(schema)
    return inlined


_BATCH_BODY_DOC = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": _inline_schema(HeartbeatBatchRequest)}},
    }
}


@router.post(
    "/heartbeats",
    response_model=HeartbeatBatchResponse,
    responses=errors(*COMMON, 400, 413),
    openapi_extra=_BATCH_BODY_DOC,
)
async def heartbeats(request: Request) -> Response:
    """Beat many nodes at once (up to 2,048), in one Redis call: for a process that holds many nodes (a host
    agent). Each beat is what GET /heartbeat does for one node, its `identity` the X-DCS-Node header; the
    answer is 200 with one outcome per beat, in order: `ok`, `not_found` (register it; GET /heartbeat's
    404) or `conflict` (another node now holds the rank; GET /heartbeat's 409).

    The hot path of a fleet: a body whose beats are all plainly valid is checked in one loop over `json.loads`;
    any other is validated by `HeartbeatBatchRequest` (422 naming what is wrong) and its identities normalised.
    The beats go to Redis packed in one argument, and the answer is written without a model."""
    raw = await read_body(request)
    topology: TopologyManager = request.app.state.services.topology
    packed = _plainly_valid_beats(raw)
    if packed is None:  # something to refuse, or to normalise: the full validation, with its named errors
        packed = _checked_beats(raw, topology.identity_required)
    now, codes = await topology.heartbeat_many_packed("\n".join(packed))
    if len(codes) != len(packed):
        raise HTTPException(status_code=503, detail=f"Redis answered {len(codes)} outcomes for {len(packed)} beats")
    results = ",".join([_ANSWERS[c] for c in codes])
    return Response(f'{{"status":"ok","timestamp":{now!r},"results":[{results}]}}', media_type="application/json")


_ROLE = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_roles_seen: set[str] = set()  # role names that matched _ROLE (few; cleared when many)


def _plainly_valid_beats(raw: bytes) -> list[str] | None:
    """The beats of `raw` packed for `TopologyManager.heartbeat_many_packed` when every one is plainly valid (a
    role, a rank in range, a canonical identity: what `HeartbeatBatchRequest` accepts and `checked_identity` keeps
    as it is), else None. A fleet's bodies take this path: one `json.loads` and a loop, no model."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):
        return None
    beats = data.get("beats") if type(data) is dict else None
    if type(beats) is not list or not 0 < len(beats) <= MAX_BATCH_NODES:
        return None
    if len(_roles_seen) > 4096:
        _roles_seen.clear()
    packed = []
    for beat in beats:
        if type(beat) is not dict:
            return None
        role, rank, identity = beat.get("role"), beat.get("rank"), beat.get("identity")
        if type(rank) is not int or not 0 <= rank <= MAX_RANK or type(identity) is not str or not identity.isascii():
            return None
        if type(role) is not str or (role not in _roles_seen and _ROLE.fullmatch(role) is None):
            return None
        if _CANONICAL_IDENTITY.fullmatch(identity) is None:
            return None
        _roles_seen.add(role)
        packed.append(f"{role}\n{rank}\n{identity}")
    return packed


def _checked_beats(raw: bytes, required: bool) -> list[str]:
    """The beats of `raw` validated by `HeartbeatBatchRequest` (422 naming what is wrong), identities checked and
    normalised, packed for `TopologyManager.heartbeat_many_packed`."""
    try:
        body = HeartbeatBatchRequest.model_validate_json(raw)
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from exc
    packed = []
    for i, b in enumerate(body.beats):
        identity = b.identity
        if not identity:
            if required:
                raise HTTPException(status_code=422, detail=IDENTITY_REQUIRED.format(where=f"beats.{i}.identity"))
        elif _CANONICAL_IDENTITY.fullmatch(identity) is None:
            identity = checked_identity(identity, f"beats.{i}.identity")
        packed.append(f"{b.role}\n{b.rank}\n{identity}")
    return packed


@router.post("/register_batch", response_model=RegisterBatchResponse, responses=errors(*COMMON, 400, 409, 413))
async def register_batch(body: RegisterBatchRequest, services: ServicesDep) -> Response:
    """Register many nodes (up to 2,048) in one call and one Redis round trip: each as /register would, in
    order (a later node of the batch sees the earlier ones' ranks). Nothing is stored when any node's
    metadata breaks a limit (422 naming the node's index)."""
    config = services.config
    for i, node in enumerate(body.nodes):
        problem = metadata_problem(
            node.metadata, config.coordinator.metadata_max_depth, config.coordinator.metadata_max_bytes
        )
        if problem is not None:
            raise HTTPException(status_code=422, detail=f"invalid request: body.nodes.{i}.{problem}")
    try:
        results = await services.topology.register_many(list(body.nodes))
    except RankConflict as exc:
        raise HTTPException(status_code=409, detail=str(exc)) from exc
    answer = RegisterBatchResponse(
        nodes=[_register_answer(node, result) for node, result in zip(body.nodes, results, strict=True)]
    )
    return Response(answer.model_dump_json(), media_type="application/json")  # built valid: not validated again


def _register_answer(body: RegisterRequest, result: Registration) -> RegisterResponse:
    return RegisterResponse(
        rank=result.rank,
        node_id=f"{body.role_name}_{result.rank}",
        message=_MESSAGES[result.kind],
        identity=result.identity,
    )


@router.post("/register", response_model=RegisterResponse, responses=errors(*COMMON, 400, 409, 413))
async def register(body: RegisterRequest, services: ServicesDep) -> RegisterResponse:
    """Register a node; a missing rank gets the smallest free one, the same node (ip:port) keeps its rank.

    The answer's `identity` fences the node's later /heartbeat and /unregister (header X-DCS-Node).
    `metadata` is bounded in nesting depth and JSON bytes (DCS_METADATA_MAX_DEPTH, DCS_METADATA_MAX_BYTES;
    422 naming the limit), so every stored record stays readable."""
    config = services.config
    problem = metadata_problem(
        body.metadata, config.coordinator.metadata_max_depth, config.coordinator.metadata_max_bytes
    )
    if problem is not None:
        raise HTTPException(status_code=422, detail=f"invalid request: body.{problem}")
    try:
        return _register_answer(body, await services.topology.register(body))
    except RankConflict as exc:
        raise HTTPException(status_code=409, detail=str(exc)) from exc


@router.delete(
    "/unregister", response_model=StatusResponse, openapi_extra=NODE_HEADER_DOC, responses=errors(*COMMON, 404, 409)
)
async def unregister(role: RoleQuery, rank: RankQuery, topology: TopologyDep, request: Request) -> StatusResponse:
    """Remove the node. Fenced like /heartbeat: with `X-DCS-Node`, 409 (nothing removed) when another node
    now holds the rank, so a replaced node shutting down cannot remove its successor."""
    try:
        removed = await topology.unregister(role, rank, caller_identity(request))
    except RankConflict as exc:
        raise HTTPException(status_code=409, detail=str(exc)) from exc
    if not removed:
        raise not_found(role, rank)
    return StatusResponse(message=f"unregistered {role}_{rank}")


@router.get("/node", response_model=RoleInfo, responses=errors(*COMMON, 404))
async def node(role: RoleQuery, rank: RankQuery, topology: TopologyDep) -> RoleInfo:
    found = await topology.get_node(role, rank)
    if found is None:
        raise not_found(role, rank)
    return found


@router.get("/peer", response_model=RoleInfo, responses=errors(*COMMON, 404))
async def peer(
    role: RoleQuery,
    rank: RankQuery,
    topology: TopologyDep,
    peer_role: Annotated[str | None, Query(min_length=1, max_length=64, pattern=ROLE_PATTERN)] = None,
) -> RoleInfo:
    """The live node of the same rank in `peer_role`, default the configured mapping of `role`."""
    target = topology.peer_role_of(role, peer_role)  # resolved here too: each 404 names what was missing
    if target is None:
        raise HTTPException(status_code=404, detail=f"role {role!r} has no peer role mapping; pass peer_role")
    found = await topology.get_peer(role, rank, target)
    if found is None:
        raise not_found(target, rank, what="peer")
    return found
