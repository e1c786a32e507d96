"""Bounds every DCS HTTP server run by uvicorn shares (the coordinator and `dcs receiver`): how long a client
may take to send a request, how large its head may be, how large a body the app may be made to buffer.

uvicorn bounds idle keep-alive connections (`timeout_keep_alive`) and the size of a request head (h11's
`max_incomplete_event_size`), but not how long a client may take to send a request: a connection opened and
left silent, or one trickling its headers a byte at a time, is held forever, and enough of them exhaust the
server's file descriptors. `guarded_h11` is uvicorn's h11 protocol plus one timer per request: it starts when
the connection opens (or the next request's first byte arrives, or a pipelined request is left half-read by
the previous answer) and the connection is closed if the request's head and body have not fully arrived when
it fires. A request already being answered (a long-poll) is not affected: the bound is on reading the
request, not on answering it; an idle kept-alive connection is uvicorn's `timeout_keep_alive`'s business.

Use: `uvicorn.Config(app, **guarded_server_options(read_timeout, keep_alive))`. `BodyLimitASGI` bounds what a
fast client can make the app buffer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Sequence
from typing import Any

import h11
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 16 * 1024  # request line + headers; a longer head is answered 431 and the connection closed
_HEAD_END = re.compile(rb"\n\r?\n")  # the blank line ending a head, as h11 finds it (bare LF accepted)
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

    def handle_events(self) -> None:
        if self.conn.their_state is h11.IDLE and self._head_too_large():
            return
        super().handle_events()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start the next cycle on pipelined bytes already buffered
        if self.conn.their_state in _RECEIVING and self._partly_received():
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _head_too_large(self) -> bool:
        """Refuse a request head (request line + headers) longer than the bound, however it arrives. h11's
        `max_incomplete_event_size` applies only while a head is incomplete, so a whole 64 KiB head in one
        read was accepted. Before h11 parses the next request (its bytes are all that is buffered while h11 is
        IDLE: the first read, or a pipelined request once the previous answer is done), the head's end must
        lie within the bound; otherwise 431 and the connection is closed."""
        limit = self.config.h11_max_incomplete_event_size or MAX_HEAD_BYTES
        pending = self.conn.trailing_data[0]
        if len(pending) <= limit or _HEAD_END.search(pending, 0, limit) is not None:  # ends within the bound
            return False
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
        log.warning("closing %s: request head over %d bytes", client, limit)
        if not self.transport.is_closing():
            body = json.dumps({"detail": f"request head over {limit} bytes"}).encode()
            self.transport.write(
                b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
                b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
            )
            self.transport.close()
        self._disarm()
        return True

    def _partly_received(self) -> bool:
        return self.conn.their_state is h11.SEND_BODY or bool(self.conn.trailing_data[0])

    def _arm(self) -> None:
        if self._read_timer is None and not self.transport.is_closing():
            self._read_timer = self.loop.call_later(self.read_timeout_seconds, self._expired)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _expired(self) -> None:
        self._read_timer = None
        if self.conn.their_state not in _RECEIVING or self.transport.is_closing():
            return
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
        level = logging.WARNING if self._partly_received() else logging.DEBUG  # silent ones: port probes
        log.log(level, "closing %s: request not received within %gs", client, self.read_timeout_seconds)
        self.transport.close()


def guarded_h11(read_timeout_seconds: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose request has not fully arrived `read_timeout_seconds`
    after the connection opened or the request's first byte came."""
    if read_timeout_seconds <= 0:
        raise ValueError(f"read_timeout_seconds must be positive, got {read_timeout_seconds}")
    return type("GuardedH11Protocol", (_GuardedH11Protocol,), {"read_timeout_seconds": read_timeout_seconds})


def guarded_server_options(
    read_timeout_seconds: float, keep_alive_seconds: float, max_head_bytes: int = MAX_HEAD_BYTES
) -> dict[str, Any]:
    """`uvicorn.Config` keyword arguments: the guarded h11 protocol, the keep-alive bound, the head size bound."""
    return {
        "http": guarded_h11(read_timeout_seconds),
        "timeout_keep_alive": keep_alive_seconds,
        "h11_max_incomplete_event_size": max_head_bytes,
    }


def header(scope: Scope, name: bytes) -> bytes | None:
    """The first value of header `name` (lower-case) of an ASGI HTTP scope."""
    return next((value for key, value in scope["headers"] if key == name), None)


async def send_json(send: Send, status: int, body: dict[str, Any], headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    """Answer a request from ASGI middleware with a JSON body (no app, no route involved)."""
    raw = json.dumps(body).encode()
    base = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": [*base, *headers]})
    await send({"type": "http.response.body", "body": raw})


class BodyLimitASGI:
    """413 `{"detail": ...}` (FastAPI's error shape) for a request body over `max_bytes`: by Content-Length
    before reading any of it, and by counting a body sent without one (chunked). `setting` (the environment
    variable that sets the bound) is named in the answer."""

    def __init__(self, app: ASGIApp, max_bytes: int, setting: str | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.message = f"request body exceeds the limit of {max_bytes} bytes" + (f" ({setting})" if setting else "")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await send_json(send, 413, {"detail": self.message})
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
