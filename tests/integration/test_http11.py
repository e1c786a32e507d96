"""The kept-alive HTTP/1.1 client the trainer calls rollout engines with (`dcs_tasks.http11`, through
`EngineAPI`): against a real uvicorn server in a thread of the test (reuse, idle close, large bodies, chunked
answers, concurrent calls), and against raw asyncio servers for what uvicorn cannot be made to do on demand
(a close crossing a request, an answer cut short, silence)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from dcs_tasks.errors import EngineAuthRefused, WeightSyncError
from dcs_tasks.http11 import AnswerTooLarge, KeepAliveClient, Target, encode_json
from dcs_tasks.sync.engine_protocol import EngineAPI, sent_direct
from dcs_tasks.sync.models import EngineEndpoint
from dcs_tasks.sync.rollout import _unreachable
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
            }
        )

    @app.get("/port")
    async def port(request: Request) -> dict[str, object]:
        return {"port": request.client.port if request.client else None}

    @app.get("/big")
    async def big(n: int) -> dict[str, object]:
        return {"data": "x" * n}

    @app.get("/chunked")
    async def chunked() -> StreamingResponse:
        async def parts() -> AsyncIterator[bytes]:
            for piece in (b'{"a":', b"[1,2,3]", b',"b":"' + b"y" * 70000 + b'"}'):
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
    with uvicorn_in_thread(_app(), "http11-uvicorn", lifespan="off", timeout_keep_alive=KEEP_ALIVE) as port:
        yield port


@pytest.fixture
async def client() -> AsyncIterator[KeepAliveClient]:
    http = KeepAliveClient({"Authorization": "Bearer t0ken"})
    yield http
    await http.aclose()


def _target(http: KeepAliveClient, port: int, path: str) -> Target:
    target = http.target(f"http://127.0.0.1:{port}{path}")
    assert target is not None
    return target


async def test_one_connection_is_kept_alive_and_reused(client: KeepAliveClient, server_port: int) -> None:
    ports = []
    for _ in range(5):
        answer = await client.request("GET", _target(client, server_port, "/port"), 5.0)
        assert answer.status_code == 200
        ports.append(answer.json()["port"])
    assert len(set(ports)) == 1, ports
    assert client.open_connections == 1


async def test_a_connection_the_server_closed_while_idle_is_replaced(client: KeepAliveClient, server_port: int) -> None:
    first = (await client.request("GET", _target(client, server_port, "/port"), 5.0)).json()["port"]
    await asyncio.sleep(KEEP_ALIVE + 0.5)  # uvicorn closes it meanwhile
    second = (await client.request("GET", _target(client, server_port, "/port"), 5.0)).json()["port"]
    assert first != second
    assert client.open_connections == 1


async def test_large_json_bodies_both_ways_arrive_whole(client: KeepAliveClient, server_port: int) -> None:
    body = {"names": [f"model.layers.{i}.mlp.weight" for i in range(200_000)], "unicode": "é✓"}
    answer = await client.request("POST", _target(client, server_port, "/echo"), 10.0, body)
    raw = encode_json(body)
    with pytest.raises(AnswerTooLarge, match="more than 1048576"):  # issue 20, finding 1: the default bound
        await client.request("GET", _target(client, server_port, "/big?n=3000000"), 10.0)
    assert answer.json()["bytes"] == len(raw) > 5_000_000
    assert answer.json()["sha"] == hashlib.sha256(raw).hexdigest()
    assert answer.json()["auth"] == "Bearer t0ken" and answer.json()["type"] == "application/json"
    big = await client.request("GET", _target(client, server_port, "/big?n=3000000"), 10.0, max_bytes=8 << 20)
    assert len(big.json()["data"]) == 3_000_000
    again = await client.request("GET", _target(client, server_port, "/port"), 5.0)  # the same connection after
    assert again.status_code == 200 and client.open_connections == 1


def test_the_body_is_encoded_byte_for_byte_as_httpx_does() -> None:
    body = {"names": ["a", "é", "✓"], "n": [1, 2.5, None, True], "nested": {"k": "v"}}
    assert encode_json(body) == httpx.Request("POST", "http://x/", json=body).content
    with pytest.raises(ValueError):
        encode_json({"nan": float("nan")})


async def test_a_chunked_answer_is_read_and_the_connection_reused(client: KeepAliveClient, server_port: int) -> None:
    answer = await client.request("GET", _target(client, server_port, "/chunked"), 5.0)
    assert answer.json() == {"a": [1, 2, 3], "b": "y" * 70000}
    await client.request("GET", _target(client, server_port, "/port"), 5.0)
    assert client.open_connections == 1


async def test_calls_at_once_to_one_origin_do_not_wait_for_each_other(
    client: KeepAliveClient, server_port: int
) -> None:
    slow = asyncio.ensure_future(client.request("GET", _target(client, server_port, "/slow?s=1"), 5.0))
    await asyncio.sleep(0.1)
    started = time.monotonic()
    await client.request("GET", _target(client, server_port, "/port"), 5.0)
    assert time.monotonic() - started < 0.5
    assert (await slow).json() == {"slept": 1.0}


async def test_a_read_timeout_is_bounded_and_a_cancelled_call_leaves_no_connection(
    client: KeepAliveClient, server_port: int
) -> None:
    started = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        await client.request("GET", _target(client, server_port, "/slow?s=3"), 0.3)
    assert time.monotonic() - started < 1.0
    assert client.open_connections == 0  # its connection is closed: a late answer must not be read as the next one's
    call = asyncio.ensure_future(client.request("GET", _target(client, server_port, "/slow?s=3"), 5.0))
    await asyncio.sleep(0.1)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert client.open_connections == 0
    assert (await client.request("GET", _target(client, server_port, "/port"), 5.0)).status_code == 200


def test_what_it_does_not_handle_is_left_to_httpx(monkeypatch: pytest.MonkeyPatch) -> None:
    http = KeepAliveClient({})
    assert http.target("https://127.0.0.1:1/x") is None
    assert http.target("http://user:pw@127.0.0.1:1/x") is None
    assert http.target("http://127.0.0.1:1/x?y=1") == Target("127.0.0.1", 1, b"/x?y=1", b"127.0.0.1:1")
    assert http.target("http://[::1]:8/x") == Target("::1", 8, b"/x", b"[::1]:8")
    assert not KeepAliveClient.accepts({"Authorization": "Bearer a\r\nX: y"})
    assert not KeepAliveClient.accepts({"Authorization": "Bearer é"})
    assert sent_direct("http://127.0.0.1:30000/health")  # no proxy in the environment
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.invalid:3128")
    monkeypatch.setenv("NO_PROXY", "10.0.0.7")
    proxied = KeepAliveClient({"Authorization": "Bearer k"}, direct=sent_direct)  # as EngineAPI builds it
    assert proxied.target("http://127.0.0.1:30000/health") is None  # httpx sends it through the proxy
    assert proxied.target("http://10.0.0.7:30000/health") is not None
    assert not KeepAliveClient.accepts({"Authorization": "Bearer bad\ntoken"})  # EngineAPI leaves it to httpx


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


async def test_a_reused_connection_closed_before_any_answer_byte_is_retried_once_on_a_fresh_one() -> None:
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
    assert isinstance(failed.value.__cause__, httpx.RemoteProtocolError)
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
        http = KeepAliveClient({})
        try:
            started = time.monotonic()
            with pytest.raises(httpx.WriteTimeout):
                await http.request("POST", _target(http, server.port, "/x"), 0.3, {"blob": "z" * 64_000_000})
            assert time.monotonic() - started < 3.0
        finally:
            await http.aclose()


async def test_engine_errors_keep_their_classification(server_port: int) -> None:
    api = EngineAPI("t0ken", 5.0)
    try:
        with pytest.raises(EngineAuthRefused):
            await api.post(_engine(server_port), "/refuse", {})
        gone = _engine(free_port())  # nothing listens there
        with pytest.raises(WeightSyncError, match="rollout_3") as failed:
            await api.post(gone, "/end_weight_update", {})
        assert isinstance(failed.value.__cause__, httpx.ConnectError)
        assert _unreachable(failed.value)
        assert not await api.alive(gone, 1.0)
        assert await api.alive(_engine(server_port), 1.0) is True
    finally:
        await api.aclose()
