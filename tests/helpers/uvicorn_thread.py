"""An ASGI app served by uvicorn in a thread of the test process, on a free loopback port."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn

from tests.helpers.ports import free_port


@contextlib.contextmanager
def uvicorn_in_thread(app: Any, name: str, **options: Any) -> Iterator[int]:
    """Serve `app` (uvicorn.Config `options` added) until the block ends; yields the port once it listens."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **options))
    thread = threading.Thread(target=server.run, name=name, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(10)
