"""Serving the coordinator with uvicorn, bounded against slow clients, with secrets scrubbed from its logs.

uvicorn closes an idle keep-alive connection (`timeout_keep_alive`) and bounds the size of a request head
(h11's `max_incomplete_event_size`), but it has no bound on how long a client may take to send a request:
a client that sends its headers one byte every few seconds holds a connection (and a file descriptor)
forever, and enough of them exhaust the server. `request_timeout_protocol` adds that bound: a client must
send a whole request, head and body, within `request_read_timeout` of the connection opening or of the
previous answer, or the connection is closed. A request already being answered (a long-poll) is not
affected: the bound is on reading the request, not on answering it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from dcs_tasks.config import DCSConfig

log = logging.getLogger(__name__)


class RequestReadTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol plus a deadline on receiving each request (head and body)."""

    request_read_timeout: float = 15.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._read_deadline: asyncio.TimerHandle | None = None
        self._arm_read_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_read_deadline()  # the next request on this connection gets the same bound

    def connection_lost(self, exc: Exception | None) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
        super().connection_lost(exc)

    def _arm_read_deadline(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
        if not self.transport.is_closing():
            self._read_deadline = self.loop.call_later(self.request_read_timeout, self._on_read_deadline)

    def _on_read_deadline(self) -> None:
        """Close the connection when the current request has not fully arrived (its head or its body)."""
        self._read_deadline = None
        if self.transport.is_closing() or self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
            return
        if self.conn.their_state is h11.SEND_BODY or self.conn.trailing_data[0]:
            client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
            log.info("closing %s: no whole request within %gs", client, self.request_read_timeout)
        self.transport.close()


def request_timeout_protocol(seconds: float) -> type[RequestReadTimeoutProtocol]:
    """A `RequestReadTimeoutProtocol` class with the given deadline (uvicorn takes a class for `http=`)."""
    return type("BoundedH11Protocol", (RequestReadTimeoutProtocol,), {"request_read_timeout": seconds})


class ScrubbingFormatter(logging.Formatter):
    """Formats like `logging.Formatter`, then masks the config's secrets (tracebacks included)."""

    def __init__(self, config: DCSConfig, fmt: str) -> None:
        super().__init__(fmt)
        self.config = config

    def format(self, record: logging.LogRecord) -> str:
        return self.config.scrub(super().format(record))


def configure_logging(config: DCSConfig, level: str) -> None:
    """Root logging for the coordinator process (uvicorn's loggers propagate to it), secrets scrubbed."""
    logging.basicConfig(level=level.upper())
    formatter = ScrubbingFormatter(config, "%(asctime)s %(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:
        handler.setFormatter(formatter)


def uvicorn_options(config: DCSConfig, log_level: str) -> dict[str, Any]:
    """Keyword arguments of `uvicorn.run` for the coordinator: bind address, the slow-client bounds."""
    return {
        "host": config.coordinator_host,
        "port": config.coordinator_port,
        "log_level": log_level,
        "log_config": None,  # keep the root handler set up by `configure_logging` (it scrubs secrets)
        "access_log": False,
        "timeout_graceful_shutdown": 5,
        "http": request_timeout_protocol(config.coordinator_request_read_timeout_seconds),
        "timeout_keep_alive": config.coordinator_keep_alive_seconds,
        "h11_max_incomplete_event_size": config.coordinator_max_header_bytes,
    }
