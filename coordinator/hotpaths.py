"""The fleet's hottest requests served without FastAPI's routing and dependency layer (pure ASGI).

`HotPaths` is the innermost middleware: auth, the browser guard, the body limit and the request metrics (the
outer layers) apply as to every request. It serves three requests itself, when they are plain:
  POST /heartbeats          a host agent's beats (the route's own code, called without the routing layer)
  GET  /recv_weight_meta    a long-poll whose query is plain digits within the route's bounds
  POST /register            a JSON body `RegisterRequest` accepts (validated as FastAPI validates it)
Anything else about them (an odd query, a body that does not validate, another content type) goes on to the
FastAPI route unchanged (a body already read is handed on), so every error answer stays the route's own: the
same status, the same named `detail`. Errors raised here go to the app's exception handlers as they would from
the route (Redis's -> 503, HTTPException -> its status, a validation error -> 422); any other exception
propagates (500). The routes stay in the OpenAPI schema; the metrics label these requests with their route.

Why: FastAPI's routing, dependency solving and response validation cost more than the work of these requests
(bench/fleet_heartbeats.py on a 2-core VM: coordinator CPU per long-poll answered and re-issued 390-430 us ->
220-250 us; per /register 500-520 us -> 330-350 us; 300 long-polls are re-issued after every append).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import ValidationError
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from coordinator.deps import Services
from coordinator.routes import ROUTERS, nodes, weight_meta
from dcs_tasks.jsonbody import lone_surrogate_in, read_body
from dcs_tasks.models import MAX_INDEX, RegisterRequest

Handler = Callable[[Scope, Receive, Send], Awaitable[None]]
JSON_HEADERS = (b"content-type", b"application/json")


class HotPaths:
    """Serves the plain forms of the hot requests (module docstring); passes everything else on to `app`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._handlers: dict[tuple[str, str], Handler] = {
            ("POST", "/heartbeats"): self._heartbeats,
            ("GET", "/recv_weight_meta"): self._recv_weight_meta,
            ("POST", "/register"): self._register,
        }
        # the routes these requests would reach, as the router would put them in the scope (the metrics' label)
        self._routes: dict[tuple[str, str], BaseRoute] = {
            (method, path): route
            for router in ROUTERS
            for route in router.routes
            if isinstance(route, APIRoute)
            for method in route.methods or ()
            if (path := route.path) and (method, path) in self._handlers
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = self._handlers.get((scope["method"], scope["path"])) if scope["type"] == "http" else None
        if handler is None:
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)

        scope["route"] = self._routes[scope["method"], scope["path"]]
        try:
            await handler(scope, receive, tracking_send)
        except (HTTPException, RequestValidationError, RedisError) as exc:
            handle = _exception_handler(scope["app"], exc)
            if handle is None or started:
                raise
            response = handle(Request(scope, receive), exc)
            if inspect.isawaitable(response):
                response = await response
            await response(scope, receive, send)

    # --- the handlers ---------------------------------------------------------------------------
    async def _heartbeats(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = await nodes.heartbeats(Request(scope, receive))
        await response(scope, receive, send)

    async def _recv_weight_meta(self, scope: Scope, receive: Receive, send: Send) -> None:
        query = plain_poll_query(scope["query_string"])
        if query is None:
            await self.app(scope, receive, send)
            return
        services: Services = scope["app"].state.services
        answer = await services.weight_meta.wait_answer(*query)
        await send_body(send, answer.body)

    async def _register(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw = await read_body(Request(scope, receive))
        body = plain_register_body(raw, _header(scope, b"content-type"))
        if body is None:
            await self.app(scope, replay(raw, receive), send)
            return
        answer = await nodes.register(body, scope["app"].state.services)
        await send_body(send, answer.model_dump_json().encode())


def _exception_handler(app: FastAPI, exc: Exception) -> Callable[[Request, Any], Any] | None:
    """The app's handler for `exc` as Starlette's ExceptionMiddleware finds it (by class, most specific first;
    `Exception`'s is the 500 handler of the outermost layer, left to it)."""
    for cls in type(exc).__mro__:
        if cls is Exception:
            return None
        handler = app.exception_handlers.get(cls)
        if handler is not None:
            return handler
    return None


def _header(scope: Scope, name: bytes) -> bytes | None:
    return next((v for k, v in scope["headers"] if k == name), None)


async def send_body(send: Send, body: bytes) -> None:
    """A 200 JSON answer, the headers Starlette's Response would send."""
    headers = [(b"content-length", str(len(body)).encode()), JSON_HEADERS]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that hands over `body` (already read) once, then goes on with `receive`."""
    pending = True

    async def again() -> Message:
        nonlocal pending
        if pending:
            pending = False
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again


_MAX_WAIT_S = weight_meta.MAX_WAIT_S
_MAX_LIMIT = weight_meta.MAX_LIMIT


def plain_poll_query(query: bytes) -> tuple[int, float, int | None] | None:
    """(index, wait_timeout_s, limit) of a /recv_weight_meta query made only of those names, each at most once,
    with plain decimal values inside the route's bounds; None for any other query (the route judges it)."""
    index, wait, limit = 0, 0.0, None
    seen: set[bytes] = set()
    if query:
        for part in query.split(b"&"):
            name, eq, value = part.partition(b"=")
            if not eq or name in seen or not 0 < len(value) <= 16:
                return None
            seen.add(name)
            if name == b"index" and value.isdigit():
                index = int(value)
                if index > MAX_INDEX:
                    return None
            elif name == b"limit" and value.isdigit():
                limit = int(value)
                if limit > _MAX_LIMIT:
                    return None
            elif name == b"wait_timeout_s" and _plain_decimal(value):
                wait = float(value)
                if wait > _MAX_WAIT_S:
                    return None
            else:
                return None
    return index, wait, limit


def _plain_decimal(value: bytes) -> bool:
    """Digits with at most one "." between them ("20", "0.5"; not ".5", "5.", "1e3", "nan")."""
    return value.replace(b".", b"", 1).isdigit() and value[:1] != b"." and value[-1:] != b"."


def plain_register_body(raw: bytes, content_type: bytes | None) -> RegisterRequest | None:
    """The /register body as FastAPI would validate it (`json.loads`, then the model in Python mode), when it
    is JSON and valid; None otherwise (the route answers with its named errors: a string with a lone surrogate
    too, which the model would take and Redis could not, see `dcs_tasks.jsonbody`)."""
    if content_type != b"application/json" or not raw or lone_surrogate_in(raw) is not None:
        return None
    try:
        return RegisterRequest.model_validate(json.loads(raw))
    except (ValueError, RecursionError, ValidationError):
        return None
