"""The one HTTP client of DCS's engine calls (`dcs_tasks.engine_http`, aiohttp; used by `EngineAPI`, the
worker's join and destroy, and `dcs engine attach`): against a real uvicorn server in a thread of the test
(reuse, idle close, large bodies, chunked answers, concurrent calls, timeouts), and against raw asyncio servers
for what uvicorn cannot be made to do on demand (a close crossing a request on a kept-alive connection, an answer
cut short, silence). Hostile answers (gigabytes, trickles): tests/integration/test_engine_hostile_answers.py."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

import dcs_tasks.engine_http as engine_http
from dcs_tasks.engine_http import (
    AnswerTooLarge,
    ConnectError,
    EngineHTTP,
    EngineTimeout,
    ProtocolError,
    ReadTimeout,
    encode_json,
    request_blocking,
)
from dcs_tasks.errors import EngineAuthRefused, WeightSyncError
from dcs_tasks.sync.engine_protocol import EngineAPI
from dcs_tasks.sync.rollout import _unreachable
from dcs_tasks.sync.wire import EngineEndpoint
from tests.helpers.ports import free_port
from tests.helpers.uvicorn_thread import uvicorn_in_thread

pytestmark = pytest.mark.integration

KEEP_ALIVE = 0.3  # the server closes an idle connection after this long


def _app() -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> JSONResponse:
        raw = await request.body()
        return JSONResponse(
            {
                "port": request.client.port if request.client else None,
                "bytes": len(raw),
                "sha": hashlib.sha256(raw).hexdigest(),
                "auth": request.headers.get("authorization"),
                "type": request.headers.get("content-type"),
                "encoding": request.headers.get("accept-encoding"),
            }
        )

    @app.get("/port")
    async def port(request: Request) -> dict[str, object]:
        return {"port": request.client.port if request.client else None}

    @app.get("/big")
    async def big(n: int) -> dict[str, object]:
        return {"data": "x" * n}

    @app.get("/chunked")
    async def chunked(request: Request) -> StreamingResponse:
        async def parts() -> AsyncIterator[bytes]:
            for piece in (b'{"a":', b"[1,2,3]", b',"b":"' + b"y" * 70000 + b'",', b'"port":%d}' % request.client.port):  # type: ignore[union-attr]
                yield piece
                await asyncio.sleep(0.01)

        return StreamingResponse(parts(), media_type="application/json")

    @app.get("/slow")
    async def slow(s: float) -> dict[str, object]:
        await asyncio.sleep(s)
        return {"slept": s}

    @app.post("/refuse")
    async def refuse() -> JSONResponse:
        return JSONResponse({"error": "Unauthorized"}, status_code=401)

    return app


@pytest.fixture(scope="module")
def server_port() -> Iterator[int]:
    with uvicorn_in_thread(_app(), "engine-http-uvicorn", lifespan="off", timeout_keep_alive=KEEP_ALIVE) as port:
        yield port


@pytest.fixture
async def client() -> AsyncIterator[EngineHTTP]:
    http = EngineHTTP({"Authorization": "Bearer t0ken"})
    yield http
    await http.aclose()


async def _port(http: EngineHTTP, port: int) -> int:
    answer = await http.request("GET", f"http://127.0.0.1:{port}/port", 5.0)
    assert answer.status == 200
    return int(answer.json()["port"])


async def test_one_connection_is_kept_alive_and_reused(client: EngineHTTP, server_port: int) -> None:
    ports = {await _port(client, server_port) for _ in range(5)}
    assert len(ports) == 1, ports


async def test_a_connection_the_server_closed_while_idle_is_replaced(client: EngineHTTP, server_port: int) -> None:
    first = await _port(client, server_port)
    await asyncio.sleep(KEEP_ALIVE + 0.5)  # uvicorn closes it meanwhile
    assert await _port(client, server_port) != first


async def test_large_json_bodies_both_ways_arrive_whole(client: EngineHTTP, server_port: int) -> None:
    body = {"names": [f"model.layers.{i}.mlp.weight" for i in range(200_000)], "unicode": "é✓"}
    answer = await client.request("POST", f"http://127.0.0.1:{server_port}/echo", 10.0, body)
    # asked at once: the server closes a connection idle for KEEP_ALIVE (0.3 s), less than encoding the body
    # again below can take on a loaded machine
    after = await _port(client, server_port)
    echoed = answer.json()
    assert after == echoed["port"]  # the same connection after a large body
    raw = encode_json(body).encode()
    assert echoed["bytes"] == len(raw) > 5_000_000 and echoed["sha"] == hashlib.sha256(raw).hexdigest()
    assert echoed["auth"] == "Bearer t0ken" and echoed["type"] == "application/json"
    assert echoed["encoding"] == "identity"  # answers are never compressed (nor decompressed: no bombs)
    with pytest.raises(AnswerTooLarge, match="more than 1048576"):  # issue 20, finding 1: the default bound
        await client.request("GET", f"http://127.0.0.1:{server_port}/big?n=3000000", 10.0)
    before = await _port(client, server_port)  # a new connection: the one left unread was closed
    big = await client.request("GET", f"http://127.0.0.1:{server_port}/big?n=3000000", 10.0, max_bytes=8 << 20)
    assert len(big.json()["data"]) == 3_000_000
    assert await _port(client, server_port) == before  # the same connection after a large answer read whole


def test_the_body_is_compact_utf8_json_and_nan_is_refused() -> None:
    body = {"names": ["a", "é", "✓"], "n": [1, 2.5, None, True], "nested": {"k": "v"}}
    assert encode_json(body) == '{"names":["a","é","✓"],"n":[1,2.5,null,true],"nested":{"k":"v"}}'
    with pytest.raises(ValueError):
        encode_json({"nan": float("nan")})


async def test_a_chunked_answer_is_read_and_the_connection_reused(client: EngineHTTP, server_port: int) -> None:
    answer = (await client.request("GET", f"http://127.0.0.1:{server_port}/chunked", 5.0)).json()
    assert answer["a"] == [1, 2, 3] and answer["b"] == "y" * 70000
    assert await _port(client, server_port) == answer["port"]


async def test_calls_at_once_to_one_origin_do_not_wait_for_each_other(client: EngineHTTP, server_port: int) -> None:
    slow = asyncio.ensure_future(client.request("GET", f"http://127.0.0.1:{server_port}/slow?s=1", 5.0))
    await asyncio.sleep(0.1)
    started = time.monotonic()
    await _port(client, server_port)
    assert time.monotonic() - started < 0.5
    assert (await slow).json() == {"slept": 1.0}


class RawServer:
    """An asyncio server whose n-th connection is answered by `handlers[n]` (the last one for any later);
    `requests` counts the request heads it read, per connection."""

    def __init__(self, *handlers: Callable[[asyncio.StreamReader, asyncio.StreamWriter, list[int]], Awaitable[None]]):
        self.handlers = handlers
        self.requests: list[int] = []
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> RawServer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        index = len(self.requests)
        self.requests.append(0)
        handler = self.handlers[min(index, len(self.handlers) - 1)]
        counter = [0]
        try:
            await handler(reader, writer, counter)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.requests[index] = counter[0]
            writer.close()


async def _read_request(reader: asyncio.StreamReader, counter: list[int]) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        (int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")), 0
    )
    counter[0] += 1
    return await reader.readexactly(length)


def _ok(body: dict[str, object]) -> bytes:
    raw = json.dumps(body).encode()
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b" % (len(raw), raw)


async def _answer_all(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, counter: list[int]) -> None:
    while True:
        await _read_request(reader, counter)
        writer.write(_ok({"success": True, "message": f"answer {counter[0]}"}))


async def _answer_once_then_drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: list[int]) -> None:
    """The keep-alive close crossing the next request: it is read, then the connection closes unanswered."""
    await _read_request(reader, n)
    writer.write(_ok({"success": True, "message": "first"}))
    await _read_request(reader, n)


async def _answer_once_then_cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: list[int]) -> None:
    """Dies while answering the second request: head and part of the body, then the close."""
    await _read_request(reader, n)
    writer.write(_ok({"success": True, "message": "first"}))
    await _read_request(reader, n)
    writer.write(b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{"succ')
    await writer.drain()


async def _silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, counter: list[int]) -> None:
    await _read_request(reader, counter)
    await asyncio.sleep(30)


async def _never_reads(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, counter: list[int]) -> None:
    await asyncio.sleep(30)


def _engine(port: int) -> EngineEndpoint:
    return EngineEndpoint(rank=3, ip="127.0.0.1", port=port)


async def test_a_reused_connection_closed_before_any_answer_is_retried_once_on_a_fresh_one() -> None:
    async with RawServer(_answer_once_then_drop, _answer_all) as server:
        api = EngineAPI(None, 5.0)
        try:
            assert await api.post(_engine(server.port), "/pause_generation", {}) == "first"
            assert await api.post(_engine(server.port), "/begin_weight_update", {}) == "answer 1"
        finally:
            await api.aclose()
        await asyncio.sleep(0.05)
    assert server.requests == [2, 1]  # the dropped request went out once more, on a second connection


async def test_an_answer_cut_short_fails_naming_the_engine_and_is_not_retried() -> None:
    async with RawServer(_answer_once_then_cut, _answer_all) as server:
        api = EngineAPI(None, 5.0)
        try:
            await api.post(_engine(server.port), "/pause_generation", {})
            with pytest.raises(WeightSyncError, match="rollout_3") as failed:
                await api.post(_engine(server.port), "/update_weights_from_distributed", {"names": ["w"]})
        finally:
            await api.aclose()
        await asyncio.sleep(0.05)
    assert server.requests == [2]  # no second connection: the answer had started
    assert isinstance(failed.value.__cause__, ProtocolError)
    assert _unreachable(failed.value)


async def test_a_fresh_connection_closed_unanswered_is_not_retried() -> None:
    async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, counter: list[int]) -> None:
        await _read_request(reader, counter)

    async with RawServer(drop) as server:
        api = EngineAPI(None, 5.0)
        try:
            with pytest.raises(WeightSyncError, match="rollout_3"):
                await api.post(_engine(server.port), "/pause_generation", {})
        finally:
            await api.aclose()
        await asyncio.sleep(0.05)
    assert server.requests == [1]


async def test_an_idle_connection_is_closed_by_the_client_before_the_engine_would(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The client's idle bound (4 s, below uvicorn's 5 s) ends a kept-alive connection the engine keeps open."""
    monkeypatch.setattr(engine_http, "KEEPALIVE_SECONDS", 0.3)
    async with RawServer(_answer_all) as server:
        http = EngineHTTP()
        try:
            for _ in range(3):
                await http.request("POST", f"http://127.0.0.1:{server.port}/x", 5.0, {})
            await asyncio.sleep(0.8)
            await http.request("POST", f"http://127.0.0.1:{server.port}/x", 5.0, {})
        finally:
            await http.aclose()
        await asyncio.sleep(0.05)
    assert server.requests == [3, 1]


async def test_a_timed_out_or_cancelled_call_leaves_its_connection_closed() -> None:
    """A late answer must never be read as the next call's: the connection of a call that ended early is closed."""
    async with RawServer(_silent, _silent, _answer_all) as server:
        http = EngineHTTP()
        url = f"http://127.0.0.1:{server.port}/x"
        try:
            started = time.monotonic()
            with pytest.raises(ReadTimeout, match=r"within 0\.3s"):
                await http.request("POST", url, 0.3, {})
            assert time.monotonic() - started < 1.0
            call = asyncio.ensure_future(http.request("POST", url, 5.0, {}))
            await asyncio.sleep(0.2)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            assert (await http.request("POST", url, 5.0, {})).json()["message"] == "answer 1"
        finally:
            await http.aclose()
        connections = len(server.requests)
    assert connections == 3  # the silent connections were not reused: the third call got one of its own


async def test_waits_are_bounded_by_the_timeout() -> None:
    async with RawServer(_silent) as server:
        api = EngineAPI(None, 0.3)
        try:
            started = time.monotonic()
            with pytest.raises(WeightSyncError, match="ReadTimeout") as failed:
                await api.post(_engine(server.port), "/pause_generation", {})
            assert time.monotonic() - started < 1.5
            assert _unreachable(failed.value)
            started = time.monotonic()
            assert not await api.alive(_engine(server.port), 0.2)  # a per-call timeout wins
            assert time.monotonic() - started < 1.0
        finally:
            await api.aclose()
    async with RawServer(_never_reads) as server:  # the request cannot be written whole
        http = EngineHTTP()
        try:
            started = time.monotonic()
            with pytest.raises(EngineTimeout):
                await http.request("POST", f"http://127.0.0.1:{server.port}/x", 0.3, {"blob": "z" * 64_000_000})
            assert time.monotonic() - started < 3.0
        finally:
            await http.aclose()


async def test_closing_the_client_is_bounded_while_a_peer_that_stopped_reading_holds_a_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """aiohttp's close waits for each connection's end, and a connection whose unsent bytes a peer never reads
    does not end: `aclose` gives up after CLOSE_TIMEOUT_SECONDS (a trainer's stop must not hang on an engine)."""
    monkeypatch.setattr(engine_http, "CLOSE_TIMEOUT_SECONDS", 0.5)
    async with RawServer(_never_reads) as server:
        http = EngineHTTP()
        call = asyncio.ensure_future(
            http.request("POST", f"http://127.0.0.1:{server.port}/x", 20.0, {"blob": "z" * 64_000_000})
        )
        try:
            await asyncio.sleep(1.0)  # connected, the socket buffers full
            started = time.monotonic()
            await asyncio.wait_for(http.aclose(), 10)
            assert time.monotonic() - started < 2.0
        finally:
            call.cancel()
            await asyncio.gather(call, return_exceptions=True)


async def test_engine_errors_keep_their_classification(server_port: int) -> None:
    api = EngineAPI("t0ken", 5.0)
    try:
        with pytest.raises(EngineAuthRefused):
            await api.post(_engine(server_port), "/refuse", {})
        gone = _engine(free_port())  # nothing listens there
        with pytest.raises(WeightSyncError, match="rollout_3") as failed:
            await api.post(gone, "/end_weight_update", {})
        assert isinstance(failed.value.__cause__, ConnectError)
        assert _unreachable(failed.value)
        assert not await api.alive(gone, 1.0)
        assert await api.alive(_engine(server_port), 1.0) is True
    finally:
        await api.aclose()


def test_a_proxy_from_the_environment_is_used_and_no_proxy_is_honoured(monkeypatch: pytest.MonkeyPatch) -> None:
    """Engines behind a proxy: the request goes to the proxy (absolute URL in the request line); NO_PROXY hosts
    are called directly. Run against a raw server playing the proxy."""

    async def main() -> list[bytes]:
        heads: list[bytes] = []

        async def proxy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            heads.append(await reader.readuntil(b"\r\n\r\n"))
            writer.write(_ok({"success": True, "message": "via proxy"}))
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(proxy, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{port}")
        monkeypatch.setenv("NO_PROXY", "")
        http = EngineHTTP()
        try:
            answer = await http.request("GET", "http://engine.invalid:30000/health", 5.0)
            assert answer.json()["message"] == "via proxy"
        finally:
            await http.aclose()
            server.close()
        return heads

    heads = asyncio.run(main())
    assert heads and heads[0].startswith(b"GET http://engine.invalid:30000/health HTTP/1.1"), heads


def test_the_blocking_form_uses_a_connection_of_its_own(server_port: int) -> None:
    """What the worker's join and destroy calls use: a loop and a connection per call."""
    answer = request_blocking("POST", f"http://127.0.0.1:{server_port}/echo", 5.0, {"a": 1}, {"Authorization": "B k"})
    assert answer.is_success and answer.json()["auth"] == "B k" and answer.json()["bytes"] == len('{"a":1}')
    with pytest.raises(ConnectError):
        request_blocking("POST", f"http://127.0.0.1:{free_port()}/x", 2.0, {})
