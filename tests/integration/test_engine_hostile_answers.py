"""Engine answers are untrusted input (issue 20, finding 1): a real TCP server playing a hostile engine answers
`/server_info`, `/model_info`, `/health` and the join POST with gigabytes, a trickle, a 5,000-digit version or
`tp_size` 10**30. Every reader of engine answers (the trainer's probe, `dcs engine attach`'s `/health` probe,
the worker's join and destroy: all over `dcs_tasks.engine_http`) bounds the bytes it holds, the total time of
the call (not per read) and the values, and names the engine in a typed error."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from dcs_tasks.engine_http import MAX_BODY_BYTES
from dcs_tasks.errors import EngineIncompatible, WeightSyncError
from dcs_tasks.sync.engine_probe import EngineProbe
from dcs_tasks.sync.engine_protocol import EngineAPI
from dcs_tasks.sync.group_bootstrap import join_engine
from dcs_tasks.sync.wire import EngineEndpoint, InitWeightsUpdateGroupRequest, JoinOutcome, JoinRequest

pytestmark = pytest.mark.integration

TIMEOUT = 1.5
MiB = 1 << 20
SENT_AT_MOST = 256 * MiB  # what the hostile server sends before it gives up (more than any bound here)


@dataclass
class Hostile:
    """A TCP server answering every request the way `mode` says; counts the body bytes it got written."""

    mode: str = "ok"
    port: int = 0
    written: list[int] = field(default_factory=list)


def _json_answer(payload: object) -> bytes:
    body = json.dumps(payload).encode()
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body) + body


async def _serve(hostile: Hostile, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            (int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")), 0
        )
        await reader.readexactly(length)
        mode, sent = hostile.mode, 0
        if mode == "big-version":
            writer.write(_json_answer({"version": "9" * 5000, "tp_size": 1}))
        elif mode == "big-tp":
            writer.write(_json_answer({"version": "0.5.23", "tp_size": 10**30, "weight_version": str(10**30)}))
        elif mode == "trickle":  # a valid head, then one body byte at a time, never enough to end
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n")
            for _ in range(100):
                writer.write(b" ")
                await writer.drain()
                await asyncio.sleep(0.3)
        elif mode == "trickle-head":
            for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 1000:
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(0.3)
        else:  # gigabytes: declared, chunked, or framed by the close
            head = {
                "declared": b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % (8 << 30),
                "chunked": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n",
                "close": b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n",
            }[mode]
            writer.write(head)
            piece = bytes(MiB)
            framed = b"%x\r\n" % len(piece) + piece + b"\r\n" if mode == "chunked" else piece
            while sent < SENT_AT_MOST:
                writer.write(framed)
                await writer.drain()
                sent += len(piece)
        await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        hostile.written.append(sent if "sent" in locals() else 0)
        writer.close()


@pytest.fixture(scope="module")
def hostile() -> Iterator[Hostile]:
    state = Hostile()
    loop = asyncio.new_event_loop()
    ready = threading.Event()

    async def start() -> asyncio.Server:
        server = await asyncio.start_server(lambda r, w: _serve(state, r, w), "127.0.0.1", 0)
        state.port = server.sockets[0].getsockname()[1]
        ready.set()
        return server

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server_future = asyncio.run_coroutine_threadsafe(start(), loop)
    ready.wait(10)
    yield state

    async def shutdown(server: asyncio.Server) -> None:
        """Close the server and end the handlers still trickling (a stopped loop would leave their coroutines to
        the garbage collector, whose `writer.close()` on a closed loop broke pytest's session end)."""
        server.close()
        handlers = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)

    asyncio.run_coroutine_threadsafe(shutdown(server_future.result()), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def _endpoint(hostile: Hostile) -> EngineEndpoint:
    return EngineEndpoint(rank=0, ip="127.0.0.1", port=hostile.port)


async def _probe(hostile: Hostile) -> WeightSyncError:
    api = EngineAPI(None, TIMEOUT)
    try:
        await api.probe(_endpoint(hostile), TIMEOUT)
    except WeightSyncError as exc:
        return exc
    finally:
        await api.aclose()
    raise AssertionError("the probe accepted a hostile answer")


@pytest.mark.parametrize("mode", ["declared", "chunked", "close", "trickle", "trickle-head"])
async def test_the_trainer_probe_bounds_bytes_and_total_time(hostile: Hostile, mode: str) -> None:
    hostile.mode = mode
    started = time.monotonic()
    error = await _probe(hostile)
    elapsed = time.monotonic() - started
    assert elapsed < TIMEOUT + 1.0, (mode, elapsed)
    assert error.member == "rollout_0" and "rollout engine rollout_0" in str(error)
    if mode.startswith("trickle"):
        assert "ReadTimeout" in str(error) and f"within {TIMEOUT:g}s" in str(error), str(error)
    else:
        assert f"than {MAX_BODY_BYTES}" in str(error) or f"more than {MAX_BODY_BYTES}" in str(error), str(error)


@pytest.mark.parametrize(
    ("mode", "reason"),
    [("big-version", "version of 5000 characters is not an SGLang"), ("big-tp", "is not an integer in 1..4096")],
)
async def test_the_trainer_probe_bounds_values(hostile: Hostile, mode: str, reason: str) -> None:
    hostile.mode = mode
    error = await _probe(hostile)
    assert isinstance(error, EngineIncompatible) and reason in str(error) and "rollout_0" in str(error)


async def test_a_weight_version_past_the_bound_reads_as_zero(hostile: Hostile) -> None:
    hostile.mode = "big-tp"  # its weight_version is str(10**30)
    api = EngineAPI(None, TIMEOUT)
    try:
        assert await api.weight_version(_endpoint(hostile), TIMEOUT) == 0
    finally:
        await api.aclose()


@pytest.mark.parametrize("mode", ["trickle", "trickle-head", "declared", "close"])
async def test_attach_health_probe_ends_within_its_timeout(hostile: Hostile, mode: str) -> None:
    """`dcs engine attach`'s `/health` probe: a trickle held it forever; now an unanswered probe in time."""
    hostile.mode = mode
    async with EngineProbe(f"http://127.0.0.1:{hostile.port}", 0, None, TIMEOUT) as engine:
        started = time.monotonic()
        probe = await engine.health(TIMEOUT)
        assert time.monotonic() - started < TIMEOUT + 1.0
    assert not probe.answered and ("ReadTimeout" in probe.reason or "AnswerTooLarge" in probe.reason), probe


@pytest.mark.parametrize("mode", ["trickle", "declared", "chunked"])
def test_the_worker_join_is_bounded(hostile: Hostile, mode: str) -> None:
    hostile.mode = mode
    body = InitWeightsUpdateGroupRequest(master_address="127.0.0.1", master_port=1, rank_offset=1, world_size=2)
    request = JoinRequest(engine=_endpoint(hostile), body=body, timeout_seconds=0.5)  # the HTTP bound: 5.5 s
    started = time.monotonic()
    result = join_engine(request)
    assert time.monotonic() - started < 5.5 + 1.0
    assert not result.success and result.node_id == "rollout_0"
    if mode == "trickle":
        assert result.outcome is JoinOutcome.TIMED_OUT
    else:
        assert result.outcome is JoinOutcome.UNREACHABLE and "AnswerTooLarge" in result.message, result
