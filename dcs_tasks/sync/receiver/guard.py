"""Hardening of the receiver's HTTP app (`secure_receiver_app`): the bearer token, JSON answers for every
error, and an OpenAPI schema that documents them.

Token: SGLang's `--api-key` rules (its api-key middleware, 0.5.23): every route but /health*, /ready*,
/metrics* and OPTIONS needs `Authorization: Bearer <DCS_AUTH_TOKEN>`; a refusal is 401 `{"error":
"Unauthorized"}`. Bodies over `receiver_max_body_bytes` are refused 413 `{"detail"}` before they are read.
Errors: a `DCSError` escaping a route is 400 `{"success": false, "message"}` (SGLang's failure shape),
anything unexpected a JSON 500 naming only the exception type; FastAPI's 422 (body does not validate) and
its 400 `{"detail"}` (body is not JSON) stay as they are.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse

from dcs_tasks.auth import SGLANG_UNAUTHORIZED, BearerAuthASGI, sglang_public
from dcs_tasks.errors import DCSError
from dcs_tasks.httpguard import BodyLimitASGI

log = logging.getLogger(__name__)

# routes whose success answer is not JSON: media type of the 200 answer (None: an empty body)
NON_JSON_ANSWERS: dict[str, str | None] = {"/metrics": "text/plain", "/health": None}


def _json_error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"success": False, "message": message}, status_code=status)


async def _rejected(request: Request, exc: Exception) -> JSONResponse:
    return _json_error(400, str(exc))


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unexpected error serving %s %s", request.method, request.url.path)
    return _json_error(500, f"internal error: {type(exc).__name__}")


def _document_errors(app: FastAPI, authenticated: bool) -> Callable[[], dict[str, Any]]:
    """`app.openapi` with the answers every route may give: 400 (SGLang's failure shape, or FastAPI's for a
    body that is not JSON), 401 when a token is required (SGLang's `{"error": "Unauthorized"}`), 422 for a
    body that does not validate; and the non-JSON answers of `NON_JSON_ANSWERS`."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {})
        schemas = components.setdefault("schemas", {})
        schemas["ReceiverError"] = _ERROR_SCHEMA
        schemas["HTTPError"] = _HTTP_ERROR_SCHEMA
        schemas["InvalidBody"] = _INVALID_BODY_SCHEMA  # SGLang's 400 for a body that does not validate
        schemas["Unauthorized"] = _UNAUTHORIZED_SCHEMA
        if authenticated:
            components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, operations in schema.get("paths", {}).items():
            for method, operation in operations.items():
                responses = operation.setdefault("responses", {})
                if path in NON_JSON_ANSWERS:
                    responses["200"] = _non_json(NON_JSON_ANSWERS[path])
                responses.setdefault("400", _answer("Refused", "ReceiverError", "HTTPError", "InvalidBody"))
                responses.setdefault("422", _answer("Body does not parse", "HTTPValidationError"))
                if method in ("post", "put", "patch"):
                    responses.setdefault("413", _answer("Body too large", "HTTPError"))
                if authenticated and not sglang_public(method.upper(), path):
                    operation["security"] = [{"bearer": []}]
                    responses["401"] = _answer("Missing or wrong bearer token", "Unauthorized")
        schemas.setdefault("HTTPValidationError", _VALIDATION_SCHEMA)
        app.openapi_schema = schema
        return schema

    return openapi


def _answer(description: str, *schemas: str) -> dict[str, Any]:
    """A JSON answer of one of the named component schemas."""
    refs = [{"$ref": f"#/components/schemas/{name}"} for name in schemas]
    body = refs[0] if len(refs) == 1 else {"anyOf": refs}
    return {"description": description, "content": {"application/json": {"schema": body}}}


def _non_json(media_type: str | None) -> dict[str, Any]:
    if media_type is None:
        return {"description": "Successful Response (empty body)"}
    return {"description": "Successful Response", "content": {media_type: {"schema": {"type": "string"}}}}


_ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"success": {"type": "boolean"}, "message": {"type": "string"}},
    "required": ["success", "message"],
}
_HTTP_ERROR_SCHEMA: dict[str, Any] = {  # FastAPI's answer to a body that is not JSON
    "type": "object",
    "properties": {"detail": {"type": "string"}},
    "required": ["detail"],
}
_INVALID_BODY_SCHEMA: dict[str, Any] = {  # SGLang's ErrorResponse (receiver.server._invalid)
    "type": "object",
    "properties": {
        "object": {"type": "string"},
        "message": {"type": "string"},
        "type": {"type": "string"},
        "param": {"type": ["string", "null"]},
        "code": {"type": "integer"},
    },
    "required": ["object", "message", "type", "code"],
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


def secure_receiver_app(app: FastAPI, token: str | None, max_body_bytes: int) -> FastAPI:
    """Refuse every route but SGLang's public ones without `token` (when set) and bodies over `max_body_bytes`,
    answer RequestRejected and any other DCSError as 400 and anything unexpected as a JSON 500, and document
    those answers in the schema."""
    app.add_exception_handler(DCSError, _rejected)
    app.add_exception_handler(Exception, _unexpected)
    app.add_middleware(BodyLimitASGI, max_bytes=max_body_bytes, setting="DCS_RECEIVER_MAX_BODY_BYTES")
    if token:  # added last: outermost, so a caller without the token is refused before its body is read
        app.add_middleware(BearerAuthASGI, token=token, is_public=sglang_public, body=SGLANG_UNAUTHORIZED)
    app.openapi = _document_errors(app, authenticated=bool(token))  # type: ignore[method-assign]
    return app
