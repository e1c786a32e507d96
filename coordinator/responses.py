"""The error answers each route documents in the OpenAPI schema (every one is JSON `{"detail": "<text>"}`).

`detail` is always a string, 422 included (the app's validation handler joins FastAPI's list into one line),
so every error is documented with `ErrorResponse`, replacing FastAPI's default list-shaped 422 schema.
"""

from __future__ import annotations

from typing import Any

from dcs_tasks.models import ErrorResponse

_WHY = {
    400: "the request is valid but not applicable (e.g. a role outside the update group, an unparsable body)",
    401: "a token is configured and the request lacks `Authorization: Bearer <DCS_AUTH_TOKEN>`",
    403: "a cross-site browser request (Origin / Sec-Fetch-Site), refused when no token is configured",
    404: "the node (or peer) is not registered or not alive",
    409: "the X-DCS-Node identity no longer holds the rank (another node took it over), or a register names "
    "a rank a live node of another identity holds (DCS_NODE_IDENTITY_REQUIRED)",
    413: "the body (DCS_MAX_BODY_BYTES) or one weight-meta entry (DCS_WEIGHT_META_ENTRY_MAX_BYTES) is too large",
    422: "invalid request: the detail names every wrong field and the limit it broke (X-DCS-Node missing "
    "where DCS_NODE_IDENTITY_REQUIRED)",
    503: "Redis is unreachable or refused the command, or no Redis connection freed up in time; retry later",
}

# every route that reaches Redis through the app: auth, the browser guard, validation, Redis
COMMON = (401, 403, 422, 503)


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` for a route: each code documented with the `ErrorResponse` model and why it happens."""
    return {code: {"model": ErrorResponse, "description": _WHY[code]} for code in sorted(set(codes))}
