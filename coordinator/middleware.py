"""Cross-cutting HTTP behaviour as pure ASGI middleware: bearer auth, the cross-site browser guard, body-size
limit, request metrics.

Pure ASGI (not BaseHTTPMiddleware) keeps the heartbeat path cheap: each layer is a dict lookup or two.
"""

from __future__ import annotations

import hmac
import json
import time
from collections.abc import Collection

from prometheus_client import CollectorRegistry, Counter, Histogram
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

PUBLIC_PATHS = frozenset({"/healthz", "/metrics"})
# label values are bounded: any other method (clients may send any token) is counted as "OTHER"
KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


async def _send_error(send: Send, status: int, detail: str, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps({"detail": detail}).encode()
    base = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": base + (headers or [])})
    await send({"type": "http.response.body", "body": body})


class BearerAuthMiddleware:
    """401 unless `Authorization: Bearer <token>` matches (constant-time), except for `public_paths`."""

    def __init__(self, app: ASGIApp, token: str, public_paths: Collection[str] = PUBLIC_PATHS) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode()
        self.public_paths = frozenset(public_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.public_paths:
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        if not hmac.compare_digest(given, self.expected):
            detail = "missing or wrong bearer token: send 'Authorization: Bearer <DCS_AUTH_TOKEN>'"
            await _send_error(send, 401, detail, [(b"www-authenticate", b"Bearer")])
            return
        await self.app(scope, receive, send)


class BrowserGuardMiddleware:
    """403 for a cross-site browser request: `Sec-Fetch-Site: cross-site|same-site`, or an `Origin` that is
    not this server's own (`Host`). The coordinator serves programs, not web pages, and has no CORS, so a page
    on another origin may not make a user's browser change its state (e.g. a GET of /clear_weight_meta from
    an <img> tag, or a form POST). Same-origin requests (the /docs page) and non-browser clients (no such
    headers) pass."""

    def __init__(self, app: ASGIApp, public_paths: Collection[str] = PUBLIC_PATHS) -> None:
        self.app = app
        self.public_paths = frozenset(public_paths)

    @staticmethod
    def refusal(headers: list[tuple[bytes, bytes]]) -> str | None:
        """Why the request is refused, or None."""
        found = {k: v for k, v in headers if k in (b"sec-fetch-site", b"origin", b"host")}
        site = found.get(b"sec-fetch-site", b"").lower()
        if site in (b"cross-site", b"same-site"):
            return f"Sec-Fetch-Site: {site.decode('latin-1')}"
        origin = found.get(b"origin")
        if origin is not None:
            host = origin.partition(b"://")[2].rstrip(b"/")
            if not host or host.lower() != found.get(b"host", b"").lower():
                return f"Origin: {origin[:200].decode('latin-1')}"
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.public_paths:
            why = self.refusal(scope["headers"])
            if why is not None:
                detail = f"cross-site browser requests are refused ({why}); call the coordinator from a program"
                await _send_error(send, 403, detail)
                return
        await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    """413 for bodies over `max_bytes`: by Content-Length up front, and by counting a streamed body."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> str:
        return f"request body exceeds the limit of {self.max_bytes} bytes (DCS_MAX_BODY_BYTES)"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await _send_error(send, 413, self._too_large())
            return
        seen = 0

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise HTTPException(status_code=413, detail=self._too_large())
            return message

        await self.app(scope, counting_receive, send)


class RequestMetrics:
    """The coordinator's own request count and latency, labelled by method, route template and status."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = Counter(
            "dcs_coordinator_requests",
            "HTTP requests handled by the coordinator",
            ["method", "route", "status"],
            registry=registry,
        )
        self.latency = Histogram(
            "dcs_coordinator_request_duration_seconds",
            "Coordinator request latency",
            ["method", "route", "status"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self._children: dict[tuple[str, str, int], tuple[Counter, Histogram]] = {}

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        """Count one request; label children are cached (`labels()` takes a lock and builds a key each call)."""
        key = (method, route, status)
        children = self._children.get(key)
        if children is None:
            code = str(status)
            children = (self.requests.labels(method, route, code), self.latency.labels(method, route, code))
            self._children[key] = children
        children[1].observe(seconds)
        children[0].inc()


class RequestMetricsMiddleware:
    """Observes every HTTP request into `RequestMetrics`; unmatched paths are labelled `<unmatched>` and
    unknown methods `OTHER`, so unauthenticated clients cannot grow the label set."""

    def __init__(self, app: ASGIApp, metrics: RequestMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        start = time.perf_counter()

        async def recording_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        finally:
            route = getattr(scope.get("route"), "path", "<unmatched>")
            method = scope["method"] if scope["method"] in KNOWN_METHODS else "OTHER"
            self.metrics.observe(method, route, status, time.perf_counter() - start)
