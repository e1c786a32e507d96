"""Serving the coordinator with uvicorn, bounded against slow clients, with secrets scrubbed from its logs.

The slow-client bounds are `dcs_tasks.httpguard`'s (shared with `dcs receiver`): a client must send a whole
request, head and body, within DCS_COORDINATOR_REQUEST_READ_TIMEOUT_SECONDS of the connection opening or of
its first byte, or the connection is closed; a request already being answered (a long-poll) is not
affected. Idle kept-alive connections close after DCS_COORDINATOR_KEEP_ALIVE_SECONDS, and a request head is
at most DCS_COORDINATOR_MAX_HEADER_BYTES.
"""

from __future__ import annotations

import logging
from typing import Any

from dcs_tasks.config import DCSConfig
from dcs_tasks.httpguard import guarded_server_options


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
        "host": config.coordinator.host,
        "port": config.coordinator.port,
        "log_level": log_level,
        "log_config": None,  # keep the root handler set up by `configure_logging` (it scrubs secrets)
        "access_log": False,
        "timeout_graceful_shutdown": 5,
        **guarded_server_options(
            config.coordinator.request_read_timeout_seconds,
            config.coordinator.keep_alive_seconds,
            config.coordinator.max_header_bytes,
        ),
    }
