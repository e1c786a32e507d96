"""Slow-client guard for DCS HTTP servers run by uvicorn (`dcs receiver`; reusable by any uvicorn server).

uvicorn bounds idle keep-alive connections (`timeout_keep_alive`) and the size of a request head (h11's
`max_incomplete_event_size`), but not how long a client may take to send a request: a connection opened and
left silent, or one trickling its headers a byte at a time, is held forever. `guarded_h11` is uvicorn's h11
protocol plus one timer per request: it starts when the connection opens (or the next request's first byte
arrives) and the connection is closed if the request's head and body have not fully arrived when it fires.

Use: `uvicorn.Config(app, **guarded_server_options(read_timeout, keep_alive))`. `BodyLimitASGI` bounds what a
fast client can make the app buffer.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import h11
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 16 * 1024  # request line + headers; a longer head is answered 400 by h11
_RECEIVING = (h11.IDLE, h11.SEND_BODY)  # their_state while a request's head or body is still arriving


class _GuardedH11Protocol(H11Protocol):
    read_timeout_seconds = 10.0
    _read_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state in _RECEIVING:
            self._arm()
        super().data_received(data)
        if self.conn.their_state not in _RECEIVING:
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._read_timer is None:
            self._read_timer = self.loop.call_later(self.read_timeout_seconds, self._expired)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _expired(self) -> None:
        self._read_timer = None
        if self.conn.their_state in _RECEIVING and not self.transport.is_closing():
            log.warning("closing %s: request not received within %gs", self.client, self.read_timeout_seconds)
            self.transport.close()


def guarded_h11(read_timeout_seconds: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose request has not fully arrived `read_timeout_seconds`
    after the connection opened or the request's first byte came."""
    if read_timeout_seconds <= 0:
        raise ValueError(f"read_timeout_seconds must be positive, got {read_timeout_seconds}")
    return type("GuardedH11Protocol", (_GuardedH11Protocol,), {"read_timeout_seconds": read_timeout_seconds})


def guarded_server_options(read_timeout_seconds: float, keep_alive_seconds: float) -> dict[str, Any]:
    """`uvicorn.Config` keyword arguments: the guarded h11 protocol, the keep-alive bound, the head size bound."""
    return {
        "http": guarded_h11(read_timeout_seconds),
        "timeout_keep_alive": keep_alive_seconds,
        "h11_max_incomplete_event_size": MAX_HEAD_BYTES,
    }


class BodyLimitASGI:
    """413 `{"detail": ...}` (FastAPI's error shape) for a request body over `max_bytes`: by Content-Length
    before reading any of it, and by counting a body sent without one (chunked)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.message = f"request body exceeds {max_bytes} bytes"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await JSONResponse({"detail": self.message}, status_code=413)(scope, receive, send)
            return
        seen = 0

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise HTTPException(status_code=413, detail=self.message)
            return message

        await self.app(scope, counting_receive, send)
