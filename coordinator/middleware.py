"""Cross-cutting HTTP behaviour as pure ASGI middleware: bearer auth (`dcs_tasks.auth`'s check with the
coordinator's public paths and error shape), the cross-site browser guard, request metrics. The body-size
limit and the slow-client guard are `dcs_tasks.httpguard`'s, shared with `dcs receiver`.

Pure ASGI (not BaseHTTPMiddleware) keeps the heartbeat path cheap: each layer is a dict lookup or two.
"""

from __future__ import annotations

import time
from collections.abc import Collection

from prometheus_client import CollectorRegistry, Counter, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dcs_tasks.httpguard import send_json

PUBLIC_PATHS = frozenset({"/healthz", "/metrics"})
# label values are bounded: any other method (clients may send any token) is counted as "OTHER"
KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
UNAUTHORIZED = {"detail": "missing or wrong bearer token: send 'Authorization: Bearer <DCS_AUTH_TOKEN>'"}
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def coordinator_public(method: str, path: str) -> bool:
    """What the coordinator serves without the token: its liveness probe and Prometheus scrape."""
    return path in PUBLIC_PATHS


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
                await send_json(send, 403, {"detail": detail})
                return
        await self.app(scope, receive, send)


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
