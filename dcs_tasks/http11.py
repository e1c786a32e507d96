"""A minimal HTTP/1.1 keep-alive client: the trainer's calls to rollout engines on plain `http://` URLs.

Why: an update makes ~5 sequential calls per engine (pause, begin, one per bucket, end, continue) while the
same process packs buckets. httpx (+ httpcore, anyio, h11) spends ~2 ms of CPU per call on a busy trainer
host and writes a request in two `send`s (head, body); this client spends ~0.2 ms and one `send`, so a
round trip to a loopback uvicorn drops from ~3 ms to ~0.6 ms (`bench/http_roundtrip.py`).

What it does: one kept-alive connection per origin (host, port), reused for the next call once the previous
answer was read whole; calls to one origin made at the same time each get a connection (none waits behind
another's answer, as with httpx's pool). Requests carry a `Content-Length` body (JSON encoded as httpx does,
byte for byte) or none; answers are framed by `Content-Length`, `Transfer-Encoding: chunked` or the
connection's close. Every wait (connect, write, each read) is bounded by the call's timeout, as httpx's
connect / write / read timeouts are. A connection the server closed while it sat idle (uvicorn closes them
after `timeout_keep_alive`, 5 s by default) is not reused; when the close crosses a request, i.e. a reused
connection ends or is reset before any byte of the answer arrived, the request is sent once more on a fresh
connection. No other failure is retried: a timeout, a refused connection or an answer cut short raise.
Bounds on what a server can make the caller hold: the whole call takes at most its timeout in total (not per
read), and an answer's body at most `max_bytes` (`MAX_BODY_BYTES`, 1 MiB; `AnswerTooLarge`). The httpx path
of the same calls gets the same bounds from `bounded_request`.

What it does not handle is left to the caller (`KeepAliveClient.target` answers None, the caller uses httpx):
other schemes (https), URLs with credentials, and URLs the caller's `direct` predicate refuses (EngineAPI:
those httpx would send through a proxy from the environment).

Failures raise httpx's own exception classes (`ConnectError`, `ConnectTimeout`, `WriteTimeout`,
`ReadTimeout`, `ReadError`, `RemoteProtocolError`: all `httpx.TransportError`), and answers are
`httpx.Response`s, so callers judge a call the same way whichever client made it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import httpx

MAX_HEAD_BYTES = 100 * 1024  # status line + headers of an answer (httpcore's bound)
MAX_BODY_BYTES = 1 << 20  # an engine answer's body: SGLang's largest (/server_info, its server args) is ~10 KiB
MAX_IDLE_PER_ORIGIN = 4
_TARGET_CACHE = 4096  # URLs whose parse is kept (engines x paths)
_CRLF2 = b"\r\n\r\n"


def encode_json(body: Any) -> bytes:
    """`body` as httpx 0.28 encodes `json=` (compact, UTF-8, NaN refused with ValueError)."""
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8")


class AnswerTooLarge(httpx.RemoteProtocolError):
    """An answer whose body is longer than the caller's bound (read no further)."""


def _total_timeout(timeout: float) -> httpx.ReadTimeout:
    return httpx.ReadTimeout(f"no whole answer within {timeout:g}s")


async def bounded_request(
    client: httpx.AsyncClient,
    method: str,
    url: str,
    timeout: float,
    max_bytes: int = MAX_BODY_BYTES,
    **kwargs: Any,
) -> httpx.Response:
    """`client.request(method, url, ...)` with the whole call (connect, head, body) bounded by `timeout` in
    total, not per read (a server trickling one byte a second never ends a per-read timeout), and the body by
    `max_bytes` (AnswerTooLarge, read no further). Bodies are asked for uncompressed. Failures are httpx's
    exception classes (`ReadTimeout` for the total bound)."""
    headers = {**kwargs.pop("headers", {}), "Accept-Encoding": "identity"}
    try:
        async with asyncio.timeout(timeout):
            async with client.stream(method, url, timeout=timeout, headers=headers, **kwargs) as response:
                declared = response.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > max_bytes:
                    raise AnswerTooLarge(f"answer of {declared} bytes, more than {max_bytes}")
                body = bytearray()
                async for chunk in response.aiter_raw():
                    body += chunk
                    if len(body) > max_bytes:
                        raise AnswerTooLarge(f"answer longer than {max_bytes} bytes")
    except TimeoutError:
        raise _total_timeout(timeout) from None
    kept = [(k, v) for k, v in response.headers.multi_items() if k.lower() not in _FRAMING]
    return httpx.Response(response.status_code, headers=kept, content=bytes(body), request=response.request)


_FRAMING = {"content-length", "transfer-encoding", "content-encoding"}


def bounded_request_blocking(
    method: str, url: str, timeout: float, max_bytes: int = MAX_BODY_BYTES, **kwargs: Any
) -> httpx.Response:
    """`bounded_request` from synchronous code (a worker task), on an event loop and client of its own."""

    async def call() -> httpx.Response:
        async with httpx.AsyncClient() as client:
            return await bounded_request(client, method, url, timeout, max_bytes, **kwargs)

    return asyncio.run(call())


class Target(NamedTuple):
    """Where a URL's request goes: its origin, the request line's target (path and query), the Host header."""

    host: str
    port: int
    path: bytes
    netloc: bytes


class _Stale(Exception):
    """A reused connection ended before any byte of the answer: the request may be sent once more."""

    def __init__(self, error: httpx.TransportError) -> None:
        super().__init__(str(error))
        self.error = error


class _Connection(asyncio.Protocol):
    """One TCP connection: what arrived (`buffer`), whether it ended, and waits bounded by a timeout."""

    def __init__(self, origin: tuple[str, int]) -> None:
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.ended = False  # EOF or connection lost
        self.lost: Exception | None = None
        self.exchanges = 0  # answers read whole on this connection
        self.received = 0  # bytes received, ever
        self.loop = asyncio.get_running_loop()
        self._paused = False
        self._waiter: asyncio.Future[bool] | None = None

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self.received += len(data)
        self._wake()

    def eof_received(self) -> bool:
        self.ended = True
        self._wake()
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.ended = True
        self.lost = exc
        self._paused = False
        self._wake()

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(True)

    async def _wait(self, timeout: float) -> bool:
        """Until something happens on the connection (True) or `timeout` passes (False)."""
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        timer = loop.call_later(timeout, _settle, waiter, False)
        try:
            return await waiter
        finally:
            timer.cancel()
            self._waiter = None

    # use
    def reusable(self) -> bool:
        """Idle, open, and nothing unasked-for arrived (a server that closed it while idle: not reusable)."""
        if self.ended or self.buffer or self.transport is None or self.transport.is_closing():
            return False
        return self.loop is asyncio.get_running_loop()  # a connection of another (maybe closed) loop: no

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        self.ended = True

    async def send(self, data: bytes, timeout: float) -> None:
        assert self.transport is not None
        if self.ended or self.transport.is_closing():
            raise self._end_error()
        self.transport.write(data)
        while self._paused and not self.ended:  # the socket's buffer is full: wait until it drains
            if not await self._wait(timeout):
                raise httpx.WriteTimeout(f"no progress writing the request for {timeout:g}s")

    async def until(self, size: int, timeout: float) -> None:
        """Until `buffer` holds `size` bytes; each wait for more bounded by `timeout`."""
        while len(self.buffer) < size:
            await self._more(timeout)

    async def line(self, start: int, sep: bytes, limit: int, timeout: float) -> int:
        """Index of `sep` in `buffer` at or after `start`, waiting for it (at most `limit` bytes from `start`)."""
        seen = start
        while True:
            found = self.buffer.find(sep, max(start, seen - len(sep)))
            if found >= 0:
                return found
            if len(self.buffer) - start > limit:
                raise httpx.RemoteProtocolError(f"answer line or head longer than {limit} bytes")
            seen = len(self.buffer)
            await self._more(timeout)

    async def rest(self, timeout: float, max_bytes: int) -> None:
        """Until the server closes the connection (an answer framed by its close), at most `max_bytes`."""
        while not self.ended:
            if len(self.buffer) > max_bytes:
                raise AnswerTooLarge(f"answer longer than {max_bytes} bytes")
            await self._wait_data(timeout)
        if len(self.buffer) > max_bytes:
            raise AnswerTooLarge(f"answer longer than {max_bytes} bytes")
        if self.lost is not None:
            raise httpx.ReadError(repr(self.lost))

    async def _more(self, timeout: float) -> None:
        if self.ended:  # the caller looked at everything that arrived before the end
            raise self._end_error()
        await self._wait_data(timeout)

    async def _wait_data(self, timeout: float) -> None:
        size = len(self.buffer)
        while len(self.buffer) == size and not self.ended:
            if not await self._wait(timeout):
                raise httpx.ReadTimeout(f"no answer byte for {timeout:g}s")

    def _end_error(self) -> httpx.TransportError:
        if self.lost is not None:
            return httpx.ReadError(repr(self.lost))
        return httpx.RemoteProtocolError("Server disconnected without sending a complete answer.")


def _settle(future: asyncio.Future[bool], value: bool) -> None:
    if not future.done():
        future.set_result(value)


class KeepAliveClient:
    """Kept-alive HTTP/1.1 connections per origin; `headers` go on every request. `direct(url)`: whether a URL
    may be sent straight to its host (False: `target` answers None, the caller uses another client)."""

    def __init__(self, headers: Mapping[str, str], direct: Callable[[str], bool] | None = None) -> None:
        lines = [b"Accept: */*\r\n", b"User-Agent: dcs\r\n"]
        for name, value in headers.items():
            lines.append(f"{name}: {value}\r\n".encode("latin-1"))
        self._headers = b"".join(lines)
        self._direct = direct
        self._targets: dict[str, Target | None] = {}
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._open: set[_Connection] = set()
        self._closed = False

    @property
    def open_connections(self) -> int:
        """Connections open now, idle or carrying a request."""
        return len(self._open)

    @staticmethod
    def accepts(headers: Mapping[str, str]) -> bool:
        """Whether `headers` can be written as they are: ASCII (httpx's default), names without separators,
        values without line breaks (else the caller leaves every request to httpx, which judges them)."""
        for name, value in headers.items():
            if not (name.isascii() and value.isascii()) or not name or any(c in name for c in ":\r\n\0 \t"):
                return False
            if any(c in value for c in "\r\n\0"):
                return False
        return True

    def target(self, url: str) -> Target | None:
        """Where `url` goes, or None when this client does not handle it."""
        try:
            return self._targets[url]
        except KeyError:
            pass
        target = self._parse(url)
        if len(self._targets) >= _TARGET_CACHE:
            self._targets.clear()
        self._targets[url] = target
        return target

    def _parse(self, url: str) -> Target | None:
        try:
            parsed = httpx.URL(url)
        except (httpx.InvalidURL, TypeError, ValueError):
            return None
        if parsed.scheme != "http" or not parsed.host or parsed.userinfo or parsed.fragment:
            return None
        if self._direct is not None and not self._direct(url):
            return None
        return Target(parsed.host, parsed.port or 80, parsed.raw_path, parsed.netloc)

    async def request(
        self, method: str, target: Target, timeout: float, json_body: Any = None, max_bytes: int = MAX_BODY_BYTES
    ) -> httpx.Response:
        """One request to `target` (from `target(url)`), with `json_body` as its JSON body unless None. The
        whole call is bounded by `timeout` in total (ReadTimeout), the answer's body by `max_bytes`
        (AnswerTooLarge)."""
        if self._closed:
            raise RuntimeError("the client has been closed")
        has_body = json_body is not None
        body = encode_json(json_body) if has_body else b""  # the caller's own work: outside the bound
        head = [f"{method} ".encode("ascii"), target.path, b" HTTP/1.1\r\nHost: ", target.netloc, b"\r\n"]
        head.append(self._headers)
        if has_body:
            head.append(b"Content-Length: %d\r\nContent-Type: application/json\r\n" % len(body))
        head.append(b"\r\n")
        data = b"".join(head) + body
        phase = ["connect"]  # how far the call got when the total bound struck: names the timeout's class
        try:
            async with asyncio.timeout(timeout):
                return await self._request(method, target, timeout, data, max_bytes, phase)
        except TimeoutError:
            where = f"{target.host}:{target.port}"
            if phase[0] == "connect":
                raise httpx.ConnectTimeout(f"no connection to {where} within {timeout:g}s") from None
            if phase[0] == "write":
                raise httpx.WriteTimeout(f"request to {where} not written within {timeout:g}s") from None
            raise _total_timeout(timeout) from None

    async def _request(
        self, method: str, target: Target, timeout: float, data: bytes, max_bytes: int, phase: list[str]
    ) -> httpx.Response:
        origin = (target.host, target.port)
        conn = self._idle_connection(origin)
        if conn is None:
            conn = await self._connect(origin, timeout)
        try:
            try:
                return await self._exchange(conn, method, data, timeout, max_bytes, phase)
            except _Stale:
                conn.close()
                self._open.discard(conn)
                phase[0] = "connect"
                conn = await self._connect(origin, timeout)
                try:
                    return await self._exchange(conn, method, data, timeout, max_bytes, phase)
                except _Stale as again:  # cannot happen on a fresh connection; kept typed all the same
                    raise again.error from None
        except BaseException:
            conn.close()
            self._open.discard(conn)
            raise

    def _idle_connection(self, origin: tuple[str, int]) -> _Connection | None:
        idle = self._idle.get(origin)
        while idle:
            conn = idle.pop()
            if conn.reusable():
                return conn
            conn.close()
            self._open.discard(conn)
        return None

    async def _connect(self, origin: tuple[str, int], timeout: float) -> _Connection:
        loop = asyncio.get_running_loop()
        conn = _Connection(origin)
        try:
            async with asyncio.timeout(timeout):
                await loop.create_connection(lambda: conn, origin[0], origin[1])
        except TimeoutError:
            raise httpx.ConnectTimeout(f"no connection to {origin[0]}:{origin[1]} within {timeout:g}s") from None
        except OSError as exc:
            raise httpx.ConnectError(repr(exc)) from exc
        self._open.add(conn)
        return conn

    async def _exchange(
        self, conn: _Connection, method: str, data: bytes, timeout: float, max_bytes: int, phase: list[str]
    ) -> httpx.Response:
        reused, before = conn.exchanges > 0, conn.received
        try:
            phase[0] = "write"
            await conn.send(data, timeout)
            phase[0] = "read"
            response, keep = await _read_response(conn, method, timeout, max_bytes)
        except (httpx.ReadError, httpx.RemoteProtocolError) as exc:
            if reused and conn.ended and conn.received == before:  # closed under us before any byte of the answer
                raise _Stale(exc) from exc
            raise
        conn.exchanges += 1
        if keep and not self._closed:
            idle = self._idle.setdefault(conn.origin, [])
            if len(idle) < MAX_IDLE_PER_ORIGIN:
                idle.append(conn)
                return response
        conn.close()
        self._open.discard(conn)
        return response

    async def aclose(self) -> None:
        self._closed = True
        for conn in list(self._open):
            conn.close()
        self._open.clear()
        self._idle.clear()


async def _read_response(
    conn: _Connection, method: str, timeout: float, max_bytes: int = MAX_BODY_BYTES
) -> tuple[httpx.Response, bool]:
    """The answer on `conn` (informational 1xx answers skipped) and whether the connection can be reused;
    `conn.buffer` keeps only what came after it."""
    while True:
        end = await conn.line(0, _CRLF2, MAX_HEAD_BYTES, timeout)
        status, http10, headers = _parse_head(bytes(conn.buffer[:end]))
        del conn.buffer[: end + 4]
        if not 100 <= status < 200:
            break
        if status == 101:
            raise httpx.RemoteProtocolError("unexpected 101 Switching Protocols")
    names = [name.lower() for name, _ in headers]
    keep = not http10 and not any(n == b"connection" and b"close" in v.lower() for n, v in headers)
    if method == "HEAD" or status in (204, 304):
        content = b""
    elif b"transfer-encoding" in names:
        codings = [v for n, v in headers if n.lower() == b"transfer-encoding"]
        if codings[-1].rsplit(b",", 1)[-1].strip().lower() == b"chunked":
            content = await _read_chunked(conn, timeout, max_bytes)
        else:
            await conn.rest(timeout, max_bytes)
            content, keep = bytes(conn.buffer), False
    elif b"content-length" in names:
        lengths = {v.strip() for n, v in headers if n.lower() == b"content-length"}
        if len(lengths) != 1 or not next(iter(lengths)).isdigit():
            raise httpx.RemoteProtocolError(f"bad Content-Length: {sorted(lengths)}")
        length = int(next(iter(lengths)))
        if length > max_bytes:
            raise AnswerTooLarge(f"answer of {length} bytes, more than {max_bytes}")
        await conn.until(length, timeout)
        content = bytes(conn.buffer[:length])
        del conn.buffer[:length]
    else:
        await conn.rest(timeout, max_bytes)
        content, keep = bytes(conn.buffer), False
    if conn.buffer:  # bytes nobody asked for: the connection's framing cannot be trusted
        keep = False
    pairs = [(n.decode("latin-1"), v.decode("latin-1")) for n, v in headers]
    return httpx.Response(status, headers=pairs, content=content), keep


def _parse_head(head: bytes) -> tuple[int, bool, list[tuple[bytes, bytes]]]:
    """(status, whether HTTP/1.0, headers) of an answer's head (without its final blank line)."""
    status_line, *lines = head.split(b"\r\n")
    parts = status_line.split(b" ", 2)
    if len(parts) < 2 or parts[0] not in (b"HTTP/1.1", b"HTTP/1.0") or not parts[1].isdigit() or len(parts[1]) != 3:
        raise httpx.RemoteProtocolError(f"not an HTTP/1.x status line: {status_line[:100]!r}")
    headers = []
    for line in lines:
        name, sep, value = line.partition(b":")
        if not sep or not name or name != name.strip() or line[:1] in (b" ", b"\t"):
            raise httpx.RemoteProtocolError(f"malformed answer header: {line[:100]!r}")
        headers.append((name, value.strip(b" \t")))
    return int(parts[1]), parts[0] == b"HTTP/1.0", headers


async def _read_chunked(conn: _Connection, timeout: float, max_bytes: int = MAX_BODY_BYTES) -> bytes:
    """A chunked body (trailers read and dropped), at most `max_bytes` (AnswerTooLarge)."""
    chunks = []
    total = 0
    while True:
        end = await conn.line(0, b"\r\n", 1024, timeout)
        size_text = bytes(conn.buffer[:end]).split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            raise httpx.RemoteProtocolError(f"bad chunk size {size_text[:40]!r}") from None
        del conn.buffer[: end + 2]
        if size == 0:
            break
        total += size
        if total > max_bytes:
            raise AnswerTooLarge(f"answer longer than {max_bytes} bytes")
        await conn.until(size + 2, timeout)
        if conn.buffer[size : size + 2] != b"\r\n":
            raise httpx.RemoteProtocolError("chunk not followed by CRLF")
        chunks.append(bytes(conn.buffer[:size]))
        del conn.buffer[: size + 2]
    while True:  # trailers, up to the blank line
        end = await conn.line(0, b"\r\n", MAX_HEAD_BYTES, timeout)
        del conn.buffer[: end + 2]
        if end == 0:
            return b"".join(chunks)
