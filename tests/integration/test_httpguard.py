"""The one slow-client guard both DCS servers run (`dcs_tasks.httpguard.guarded_server_options`), on a real
uvicorn server: a request must fully arrive within the read bound, however it reaches the server, while an
idle kept-alive connection is left to the keep-alive bound and a long answer is never cut."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from dcs_tasks.httpguard import MAX_HEAD_BYTES, guarded_server_options
from tests.helpers.uvicorn_thread import uvicorn_in_thread

pytestmark = pytest.mark.integration

READ_BOUND = 0.5
KEEP_ALIVE = 30.0  # far above the read bound: a close within a few seconds is the read bound's doing


async def _slow(request: Request) -> PlainTextResponse:
    await asyncio.sleep(float(request.query_params.get("s", "0")))
    return PlainTextResponse("ok")


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    app = Starlette(routes=[Route("/", _slow)])
    with uvicorn_in_thread(app, "guarded-uvicorn", **guarded_server_options(READ_BOUND, KEEP_ALIVE)) as chosen:
        yield chosen


def _closed_after(sock: socket.socket, give_up_s: float) -> tuple[bytes, float | None]:
    """Everything the server sent, and seconds until it closed the connection (None: not within give_up_s)."""
    start, received = time.monotonic(), b""
    sock.settimeout(0.1)
    while time.monotonic() - start < give_up_s:
        try:
            chunk = sock.recv(4096)
        except TimeoutError:
            continue
        except OSError:
            return received, time.monotonic() - start
        if chunk == b"":
            return received, time.monotonic() - start
        received += chunk
    return received, None


def test_a_silent_connection_is_closed_at_the_read_bound(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        _, closed = _closed_after(sock, 5)
    assert closed is not None and closed < READ_BOUND + 1.5, closed


def test_a_half_sent_pipelined_request_is_closed_at_the_read_bound(port: int) -> None:
    """A whole request followed by the start of the next in one write: the first is answered; the second's
    clock runs from the answer, not from the keep-alive bound."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\nGET / HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        received, closed = _closed_after(sock, 8)
    assert received.startswith(b"HTTP/1.1 200") and received.count(b"HTTP/1.1") == 1, received
    assert closed is not None and closed < READ_BOUND + 2.0, closed


def test_an_idle_kept_alive_connection_and_a_long_answer_are_not_cut(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(READ_BOUND * 4)  # idle between requests: keep-alive's business, not the read bound's
        sock.sendall(b"GET /?s=2 HTTP/1.1\r\nHost: x\r\n\r\n")  # an answer that takes 4x the read bound
        sock.settimeout(10)
        received = b""
        while received.count(b"ok") < 2:
            chunk = sock.recv(4096)
            assert chunk, f"closed early; got {received!r}"
            received += chunk
    assert received.count(b"HTTP/1.1 200") == 2


def _head(size: int) -> bytes:
    """A GET whose head (request line, headers, blank line) is exactly `size` bytes."""
    start, end = b"GET / HTTP/1.1\r\nHost: x\r\nX-Pad: ", b"\r\n\r\n"
    return start + b"a" * (size - len(start) - len(end)) + end


@pytest.mark.parametrize("size", [MAX_HEAD_BYTES + 1, 64 * 1024])
def test_a_head_over_the_bound_sent_in_one_write_is_refused_431(port: int, size: int) -> None:
    """Issue 20, finding 10: h11's `max_incomplete_event_size` bounds only a head still arriving, so a 64 KiB
    head in one write was answered 200 although the docs say 16 KiB."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(_head(size))
        received, closed = _closed_after(sock, 5)
    assert received.startswith(b"HTTP/1.1 431") and b"request head over 16384 bytes" in received, received[:200]
    assert closed is not None


def test_a_head_at_the_bound_passes_and_a_pipelined_one_over_it_closes(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(_head(MAX_HEAD_BYTES) + _head(64 * 1024))
        received, closed = _closed_after(sock, 5)
    assert received.startswith(b"HTTP/1.1 200") and received.count(b"HTTP/1.1") == 2, received[:300]
    assert b"HTTP/1.1 431" in received and closed is not None
    with socket.create_connection(("127.0.0.1", port)) as sock:  # a head with bare LF line ends and a body
        sock.sendall(b"GET / HTTP/1.1\nHost: x\ncontent-length: 40000\n\n" + b"b" * 40_000)
        sock.settimeout(5)
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
