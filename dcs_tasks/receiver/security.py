"""What a `dcs receiver` checks before it acts on a request: the checks run before any tensor is allocated or
any connection opened, and a refusal is a `RequestRejected` naming what was wrong (answered 400).

Update bodies: every dtype from `fusion`'s table, every shape non-negative with at most `MAX_DIMS` dims, names
unique, 1..`MAX_NAME_LENGTH` characters and at most `MAX_TENSORS` of them, the total bytes within the update
limit. Init bodies: a plausible host name or IP literal, a bounded world size with the rank inside it, a
group name of safe characters. `secure_receiver_app` adds the bearer-token check (SGLang's `--api-key`
rules: all but /health*, /ready*, /metrics* and OPTIONS need it), JSON answers for every error, and documents
400/401/422 in the OpenAPI schema.
"""

from __future__ import annotations

import ipaddress
import logging
import re
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse

from dcs_tasks.auth import SGLANG_UNAUTHORIZED, BearerAuthASGI, sglang_public
from dcs_tasks.backends.base import GroupSpec
from dcs_tasks.backends.fusion import parse_dtype
from dcs_tasks.errors import DCSError, RequestRejected

log = logging.getLogger(__name__)

MAX_TENSORS = 1_000_000  # per request
MAX_NAME_LENGTH = 1024
MAX_DIMS = 16
MAX_WORLD_SIZE = 65_536
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9\-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(?:\.{_LABEL})*$")
_GROUP_NAME = re.compile(r"^[A-Za-z0-9_.:\-]{1,256}$")


def tensor_bytes(dtype: str, shape: Sequence[int]) -> int:
    """Bytes of one tensor (exact Python integers: no overflow); RequestRejected for a bad dtype or shape."""
    try:
        itemsize = parse_dtype(dtype).itemsize
    except ValueError as exc:
        raise RequestRejected(str(exc)) from None
    if len(shape) > MAX_DIMS:
        raise RequestRejected(f"shape {list(shape)[: MAX_DIMS + 1]}... has more than {MAX_DIMS} dimensions")
    numel = 1
    for dim in shape:
        if dim < 0:
            raise RequestRejected(f"shape {list(shape)} has a negative dimension")
        numel *= dim
    return numel * itemsize


def check_names(names: Sequence[str]) -> None:
    if len(names) > MAX_TENSORS:
        raise RequestRejected(f"{len(names)} tensors in one request; at most {MAX_TENSORS}")
    for name in names:
        if not 0 < len(name) <= MAX_NAME_LENGTH:
            raise RequestRejected(f"tensor name {name[:64]!r} must be 1..{MAX_NAME_LENGTH} characters")
    if len(set(names)) != len(names):
        raise RequestRejected("tensor names repeat within one request")


def check_tensors(
    names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]], max_bytes: int | None
) -> int:
    """The payload bytes of the tensors announced, once they passed every check; RequestRejected otherwise."""
    if not len(names) == len(dtypes) == len(shapes):
        raise RequestRejected(f"names/dtypes/shapes lengths differ: {len(names)}/{len(dtypes)}/{len(shapes)}")
    check_names(names)
    total = 0
    for dtype, shape in zip(dtypes, shapes, strict=True):
        total += tensor_bytes(dtype, shape)
        if max_bytes is not None and total > max_bytes:
            raise RequestRejected(
                f"update announces more than {max_bytes} bytes (receiver_max_update_bytes); refused before allocating"
            )
    return total


def check_address(address: str) -> None:
    """An IP literal or a syntactically valid host name (no URL, port, path or spaces)."""
    try:
        ipaddress.ip_address(address)
        return
    except ValueError:
        pass
    if not _HOSTNAME.match(address):
        raise RequestRejected(f"master_address {address[:80]!r} is neither an IP address nor a host name")


def check_group_spec(spec: GroupSpec) -> None:
    """RequestRejected unless `spec` names a plausible group to join."""
    check_address(spec.master_address)
    if not _GROUP_NAME.match(spec.group_name):
        raise RequestRejected(f"group_name {spec.group_name[:80]!r} must be 1..256 of A-Z a-z 0-9 _ . : -")
    if not 0 < spec.world_size <= MAX_WORLD_SIZE:
        raise RequestRejected(f"world_size {spec.world_size} must be 1..{MAX_WORLD_SIZE}")
    if not 0 <= spec.rank < spec.world_size:
        raise RequestRejected(f"rank {spec.rank} must be below world_size {spec.world_size}")


def _json_error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"success": False, "message": message}, status_code=status)


async def _rejected(request: Request, exc: Exception) -> JSONResponse:
    return _json_error(400, str(exc))


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unexpected error serving %s %s", request.method, request.url.path)
    return _json_error(500, f"internal error: {type(exc).__name__}")


def _document_errors(app: FastAPI, authenticated: bool) -> Callable[[], dict[str, Any]]:
    """`app.openapi` with the answers every route may give: 400 (SGLang's failure shape), 401 when a token is
    required (SGLang's `{"error": "Unauthorized"}`), 422 for a body or query that does not parse."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {})
        schemas = components.setdefault("schemas", {})
        schemas["ReceiverError"] = _ERROR_SCHEMA
        schemas["Unauthorized"] = _UNAUTHORIZED_SCHEMA
        if authenticated:
            components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, operations in schema.get("paths", {}).items():
            for method, operation in operations.items():
                responses = operation.setdefault("responses", {})
                responses.setdefault("400", _answer("Refused", "ReceiverError"))
                responses.setdefault("422", _answer("Body does not parse", "HTTPValidationError"))
                if authenticated and not sglang_public(method.upper(), path):
                    operation["security"] = [{"bearer": []}]
                    responses["401"] = _answer("Missing or wrong bearer token", "Unauthorized")
        schemas.setdefault("HTTPValidationError", _VALIDATION_SCHEMA)
        app.openapi_schema = schema
        return schema

    return openapi


def _answer(description: str, schema: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}},
    }


_ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"success": {"type": "boolean"}, "message": {"type": "string"}},
    "required": ["success", "message"],
}
_UNAUTHORIZED_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"error": {"type": "string"}},
    "required": ["error"],
}
_VALIDATION_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"detail": {"type": "array", "items": {"type": "object"}}},
}


def secure_receiver_app(app: FastAPI, token: str | None) -> FastAPI:
    """Refuse every route but SGLang's public ones without `token` (when set), answer RequestRejected and any
    other DCSError as 400 and anything unexpected as a JSON 500, and document those answers in the schema."""
    app.add_exception_handler(DCSError, _rejected)
    app.add_exception_handler(Exception, _unexpected)
    if token:
        app.add_middleware(BearerAuthASGI, token=token, is_public=sglang_public, body=SGLANG_UNAUTHORIZED)
    app.openapi = _document_errors(app, authenticated=bool(token))  # type: ignore[method-assign]
    return app
