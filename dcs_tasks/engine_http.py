"""The one HTTP client of every call DCS makes to a rollout engine: the trainer's update calls
(`sync/engine_protocol.EngineAPI`), the worker's join and destroy calls (`dcs_tasks/sync/group_bootstrap.py`) and
`dcs engine attach`'s `/health` probes and server-info read (`sync/engine_probe.py`).

It is aiohttp (its C parser; https and proxies from the environment built in), kept alive per engine by
aiohttp's connector. `bench/http_roundtrip.py` measured it against the hand-written HTTP/1.1 client it
replaces (`dcs_tasks/http11.py`, removed) and httpx, CPU per call: +0.04 and +0.07 ms against the hand-written
one on the 2-core machine at load 1.3-4.1, +0.2-0.4 ms at load 5-11 (the hand-written one: 0.20-0.44 ms), and
a quarter of httpx's (bench/results/http_roundtrip/).

What is DCS's own on top of aiohttp:
- Bounds on what an engine can make DCS hold (an engine's answer is untrusted input): every call, connect and
  answer included, takes at most its timeout in total (not per read: a server trickling one byte a second
  never ends a per-read timeout); an answer's body is at most `max_bytes` (`MAX_BODY_BYTES`, 1 MiB;
  `AnswerTooLarge`, read no further), its head at most aiohttp's line and field limits (8 KiB each, 128
  headers). Bodies are asked for uncompressed and never decompressed.
- Keep-alive: an idle connection is closed after `KEEPALIVE_SECONDS` (4 s), before uvicorn's 5-s idle close
  (SGLang's server and `dcs receiver` both run uvicorn), so a connection is not reused just as the engine
  closes it. When that still happens (a reused connection closed before any answer), the request is sent
  once more on a fresh connection; no other failure is retried (a timeout, a refused connection, an answer
  cut short, or a fresh connection closed unanswered raise).
- Failures are this module's classes (`EngineHTTPError` and below), answers an `Answer` (status and body).
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import urllib.parse
import urllib.request
import weakref
from collections.abc import Mapping
from typing import Any, NamedTuple

import aiohttp

MAX_BODY_BYTES = 1 << 20  # an engine answer's body: SGLang's largest (/server_info, its server args) is ~10 KiB
KEEPALIVE_SECONDS = 4.0  # an idle connection's life: below uvicorn's default 5-s idle close
_PROXY_CACHE = 4096  # URLs whose proxy (or none) is kept (engines x paths)
CLOSE_TIMEOUT_SECONDS = 5.0  # aclose's wait for the connections to close (aiohttp waits for each one's end)

log = logging.getLogger(__name__)


class EngineHTTPError(Exception):
    """A call to an engine that got no whole answer."""


class ConnectError(EngineHTTPError):
    """No connection to the engine (refused, unreachable, name not resolved)."""


class EngineTimeout(EngineHTTPError):
    """The call's total bound ran out."""


class ConnectTimeout(EngineTimeout):
    """No connection within the call's timeout."""


class ReadTimeout(EngineTimeout):
    """Connected, but no whole answer within the call's timeout."""


class ProtocolError(EngineHTTPError):
    """The engine closed the connection before a whole answer, or sent something that is not HTTP/1.x."""


class AnswerTooLarge(ProtocolError):
    """An answer whose body is longer than the caller's bound (read no further)."""


class Answer(NamedTuple):
    """An engine's whole answer."""

    status: int
    body: bytes

    @property
    def is_success(self) -> bool:
        return 200 <= self.status < 300

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")

    def json(self) -> Any:
        """The body as JSON; ValueError when it is not."""
        return json.loads(self.body)


def encode_json(body: Any) -> str:
    """`body` as compact JSON (UTF-8, NaN refused with ValueError): what SGLang's own clients send."""
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


class _Call:
    """What one attempt got to: a connection, and whether it had carried an earlier call (reused)."""

    __slots__ = ("connected", "reused")

    def __init__(self) -> None:
        self.connected = False
        self.reused = False


_CALL: contextvars.ContextVar[_Call | None] = contextvars.ContextVar("dcs_engine_http_call", default=None)


class _Connector(aiohttp.TCPConnector):
    """aiohttp's connector, noting on the current call whether the connection it hands out is a reused one
    (aiohttp's trace hooks tell the same, at more CPU per call)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._seen: weakref.WeakSet[object] = weakref.WeakSet()

    async def connect(self, req: Any, traces: Any, timeout: Any) -> Any:
        conn = await super().connect(req, traces, timeout)
        call, protocol = _CALL.get(), conn.protocol
        if call is not None:
            call.connected = True
            call.reused = protocol in self._seen
        if protocol is not None:
            self._seen.add(protocol)
        return conn


class EngineHTTP:
    """HTTP calls to engines; `headers` go on every request (SGLang's API key). `keep_alive=False`: a new
    connection per call (one-off calls from synchronous code). Made anywhere; its aiohttp session is made on
    first use, on the running loop (and again on another loop)."""

    def __init__(self, headers: Mapping[str, str] | None = None, keep_alive: bool = True) -> None:
        self._headers = {"Accept-Encoding": "identity", **(headers or {})}
        self._keep_alive = keep_alive
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._proxies: dict[str, str | None] = {}

    def _session_here(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._loop is not loop or self._session.closed:
            if self._keep_alive:
                connector = _Connector(keepalive_timeout=KEEPALIVE_SECONDS)
            else:
                connector = _Connector(force_close=True)
            self._session = aiohttp.ClientSession(
                connector=connector,
                headers=self._headers,
                timeout=aiohttp.ClientTimeout(),  # no aiohttp timer: `request` bounds the whole call itself
                auto_decompress=False,
                json_serialize=encode_json,
            )
            self._loop = loop
        return self._session

    def _proxy(self, url: str) -> str | None:
        """The proxy `url` goes through: the environment's HTTP_PROXY / HTTPS_PROXY for its scheme unless
        NO_PROXY covers its host (the standard library's reading, as aiohttp's `trust_env`, which would read it
        again on every call), kept per URL."""
        try:
            return self._proxies[url]
        except KeyError:
            pass
        parts = urllib.parse.urlsplit(url)
        proxy = urllib.request.getproxies().get(parts.scheme)
        if proxy and urllib.request.proxy_bypass(parts.hostname or ""):
            proxy = None
        if len(self._proxies) >= _PROXY_CACHE:
            self._proxies.clear()
        self._proxies[url] = proxy or None
        return proxy or None

    async def request(
        self, method: str, url: str, timeout: float, json_body: Any = None, max_bytes: int = MAX_BODY_BYTES
    ) -> Answer:
        """One call with `json_body` as its JSON body unless None. The whole call is bounded by `timeout`
        (ConnectTimeout / ReadTimeout), the answer's body by `max_bytes` (AnswerTooLarge)."""
        if self._closed:
            raise RuntimeError("the engine HTTP client has been closed")
        session = self._session_here()
        proxy = self._proxy(url)
        call = _Call()
        token = _CALL.set(call)
        try:
            async with asyncio.timeout(timeout):
                try:
                    return await _exchange(session, method, url, json_body, max_bytes, proxy)
                except aiohttp.ServerDisconnectedError:
                    if not call.reused:
                        raise
                    call = _Call()  # the engine closed a kept-alive connection as it was reused: once more
                    _CALL.set(call)
                    return await _exchange(session, method, url, json_body, max_bytes, proxy)
        except TimeoutError:
            if not call.connected:
                raise ConnectTimeout(f"no connection to {url} within {timeout:g}s") from None
            raise ReadTimeout(f"no whole answer from {url} within {timeout:g}s") from None
        except aiohttp.ClientConnectorError as exc:
            raise ConnectError(f"{url}: {exc}") from exc
        except aiohttp.ClientError as exc:  # disconnected, malformed answer, cut short
            raise ProtocolError(f"{url}: {type(exc).__name__}: {exc}") from exc
        finally:
            _CALL.reset(token)

    async def aclose(self) -> None:
        """Close every connection; waits at most CLOSE_TIMEOUT_SECONDS for them to end (aiohttp's own close
        waits for each transport's end, which a peer that stopped reading can hold back), then leaves them to
        the event loop."""
        self._closed = True
        session, self._session = self._session, None
        if session is None or self._loop is not asyncio.get_running_loop():
            return
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT_SECONDS):
                await session.close()
        except TimeoutError:
            log.warning("engine connections still closing after %gs: left to close on their own", CLOSE_TIMEOUT_SECONDS)


async def _exchange(
    session: aiohttp.ClientSession, method: str, url: str, json_body: Any, max_bytes: int, proxy: str | None
) -> Answer:
    kwargs: dict[str, Any] = {"json": json_body} if json_body is not None else {}
    if proxy is not None:
        kwargs["proxy"] = proxy
    async with session.request(method, url, allow_redirects=False, **kwargs) as response:
        declared = response.content_length
        if declared is not None and declared > max_bytes:
            raise AnswerTooLarge(f"answer of {declared} bytes, more than {max_bytes}")
        body = bytearray()
        async for chunk in response.content.iter_any():
            body += chunk
            if len(body) > max_bytes:
                raise AnswerTooLarge(f"answer longer than {max_bytes} bytes")
        return Answer(response.status, bytes(body))


def request_blocking(
    method: str,
    url: str,
    timeout: float,
    json_body: Any = None,
    headers: Mapping[str, str] | None = None,
    max_bytes: int = MAX_BODY_BYTES,
) -> Answer:
    """`EngineHTTP.request` from synchronous code (a worker task), on an event loop and connection of its own."""

    async def call() -> Answer:
        http = EngineHTTP(headers, keep_alive=False)
        try:
            return await http.request(method, url, timeout, json_body, max_bytes)
        finally:
            await http.aclose()

    return asyncio.run(call())
