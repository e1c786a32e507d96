"""Round trip of the trainer's calls to a rollout engine: DCS's engine client (`dcs_tasks.engine_http`,
aiohttp), bare aiohttp, httpx, and the hand-written HTTP/1.1 client DCS used before (`dcs_tasks/http11.py`,
measured while it existed; removed since, its figures are in bench/results/http_roundtrip/).

Two receiver apps as `dcs receiver` serves them (the same FastAPI app, guards and uvicorn options; no
coordinator), each in a process of its own on loopback. Each contender does what `EngineAPI.post` does (a JSON
body, the whole call bounded by its timeout, the answer read up to 1 MiB, JSON decoded, status judged):
  engine           `EngineAPI.post` as DCS ships it (dcs_tasks/engine_http.py over aiohttp)
  aiohttp          one kept-alive aiohttp session, nothing of DCS's around it
  httpx            one httpx.AsyncClient, the answer streamed and bounded
  http11           the removed hand-written client (only where dcs_tasks/http11.py still exists)
Timed from this process:
  call             one POST /pause_generation: wall time and this thread's CPU time
  frame            an update's engine frame on both engines at once: per engine pause, begin, end, continue
  frame_packing    the same frame while a 32 MiB bucket of 300 tensors is packed in a worker thread (as
                   `BucketSender.send_fused` does), and how long that packing took meanwhile (`pack_alone`:
                   without the frame)
Medians over --rounds rounds, each a block of every contender in turn (the order rotates; one warm-up round
dropped), so a change in the machine's load falls on every contender alike; writes a
result file under bench/results/http_roundtrip/. The figures are fractions of a millisecond: any other load
moves them, so compare contenders within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.harness import REPO, Row, Run, free_port, wait_for_port
from bench.weight_sync import make_state
from dcs_tasks.sync.engine_protocol import EngineAPI
from dcs_tasks.sync.sender import BucketSender
from dcs_tasks.sync.wire import EngineEndpoint

CLIENTS = ("engine", "aiohttp", "httpx", "http11")
FRAME = ("/pause_generation", "/begin_weight_update", "/end_weight_update", "/continue_generation")


def serve(port: int) -> None:
    """One receiver app on 127.0.0.1:`port`, served as `dcs receiver` serves it (runs until killed)."""
    import gc
    import socket
    from concurrent.futures import ThreadPoolExecutor

    import uvicorn

    from dcs_tasks.backends.device_direct import DeviceDirectBackend
    from dcs_tasks.config import DCSConfig, RoleInfo
    from dcs_tasks.httpguard import guarded_server_options
    from dcs_tasks.sync.receiver.guard import secure_receiver_app
    from dcs_tasks.sync.receiver.server import create_receiver_app
    from dcs_tasks.sync.receiving import WeightReceiver

    config = DCSConfig()
    info = RoleInfo(role_name="rollout", rank=0, ip="127.0.0.1", port=port, metadata={})
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind(("127.0.0.1", port))

    async def main() -> None:
        backend = DeviceDirectBackend(config.sync.backend_type, info, timeout_seconds=30, group_init_timeout_seconds=30)
        app = create_receiver_app(WeightReceiver(backend))
        secure_receiver_app(app, config.token(), config.receiver.max_body_bytes)
        options = guarded_server_options(
            config.receiver.request_read_timeout_seconds, config.receiver.keep_alive_seconds
        )
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", **options))
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(4))
        gc.freeze()
        await server.serve(sockets=[sock])

    asyncio.run(main())


@contextmanager
def receivers(count: int, logs: Path) -> Iterator[list[EngineEndpoint]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DCS_")}
    env["PYTHONPATH"] = str(REPO)
    procs, engines = [], []
    try:
        for rank in range(count):
            port = free_port()
            with (logs / f"receiver{rank}.log").open("ab") as out:
                cmd = [sys.executable, __file__, "--serve", str(port)]
                procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT))
            engines.append(EngineEndpoint(rank=rank, ip="127.0.0.1", port=port))
        for engine in engines:
            wait_for_port(engine.port, 60)
        yield engines
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(10)


class Poster(Protocol):
    async def post(self, engine: EngineEndpoint, path: str, body: dict[str, Any]) -> str: ...

    async def aclose(self) -> None: ...


MAX_BYTES = 1 << 20


def _judge(path: str, status: int, data: bytes) -> str:
    answer = json.loads(data) if data else {}
    if status >= 400 or answer.get("success") is False:
        raise RuntimeError(f"{path} refused ({status})")
    return str(answer.get("message", ""))


class AiohttpAPI:
    """One aiohttp session, keep-alive by its connector (4 s, below uvicorn's 5-s idle close), the whole call
    bounded by `timeout`, at most 1 MiB of answer."""

    def __init__(self, timeout: float) -> None:
        import aiohttp

        self._aiohttp = aiohttp
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None

    async def post(self, engine: EngineEndpoint, path: str, body: dict[str, Any]) -> str:
        if self._session is None:
            connector = self._aiohttp.TCPConnector(keepalive_timeout=4.0)
            self._session = self._aiohttp.ClientSession(
                connector=connector, timeout=self._timeout, auto_decompress=False
            )
        async with self._session.post(f"{engine.url}{path}", json=body) as response:
            data = b""
            async for chunk in response.content.iter_any():
                data += chunk
                if len(data) > MAX_BYTES:
                    raise RuntimeError("answer too large")
        return _judge(path, response.status, data)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


class HttpxAPI:
    """One httpx.AsyncClient (kept alive by its pool), the answer streamed and bounded as above."""

    def __init__(self, timeout: float) -> None:
        import httpx

        self._http = httpx.AsyncClient(timeout=timeout)
        self._timeout = timeout

    async def post(self, engine: EngineEndpoint, path: str, body: dict[str, Any]) -> str:
        async with asyncio.timeout(self._timeout):
            async with self._http.stream("POST", f"{engine.url}{path}", json=body) as response:
                data = b""
                async for chunk in response.aiter_raw():
                    data += chunk
                    if len(data) > MAX_BYTES:
                        raise RuntimeError("answer too large")
        return _judge(path, response.status_code, data)

    async def aclose(self) -> None:
        await self._http.aclose()


class Http11API:
    """The removed hand-written client (dcs_tasks/http11.py), where this checkout still has it."""

    def __init__(self, timeout: float) -> None:
        http11 = importlib.import_module("dcs_tasks.http11")
        self._http = http11.KeepAliveClient({})
        self._timeout = timeout

    async def post(self, engine: EngineEndpoint, path: str, body: dict[str, Any]) -> str:
        url = f"{engine.url}{path}"
        response = await self._http.request("POST", self._http.target(url), self._timeout, body)
        return _judge(path, response.status_code, response.content)

    async def aclose(self) -> None:
        await self._http.aclose()


def has_http11() -> bool:
    return importlib.util.find_spec("dcs_tasks.http11") is not None


def contender(name: str, timeout: float) -> Poster:
    makers: dict[str, Callable[[float], Poster]] = {
        "engine": lambda t: EngineAPI(None, t),
        "aiohttp": AiohttpAPI,
        "httpx": HttpxAPI,
        "http11": Http11API,
    }
    return makers[name](timeout)


Samples = dict[str, list[float]]


async def timed(call: Callable[[], Awaitable[object]], repeats: int, wall: str, cpu: str, out: Samples) -> None:
    """Wall and this thread's CPU seconds of `repeats` calls of `call` into `out[wall]`, `out[cpu]`."""
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.thread_time()
        await call()
        out.setdefault(wall, []).append(time.perf_counter() - t0)
        out.setdefault(cpu, []).append(time.thread_time() - c0)


class Bench:
    """The three measures for one contender; `block` adds `repeats` samples of each to `samples`."""

    def __init__(self, api: Poster, engines: list[EngineEndpoint]) -> None:
        self.api, self.engines = api, engines
        self.state = make_state(32, 300)
        self.sender = BucketSender(None, torch.device("cpu"), 256 * 1024 * 1024, sglang=True)  # type: ignore[arg-type]
        self.layout = self.sender.plan(self.state)[0]
        self.slot = self.sender._buffers([self.layout])[0]
        self.samples: Samples = {}

    def pack(self) -> float:
        t0 = time.perf_counter()
        self.sender._pack(self.slot, self.layout, self.state, None)
        return time.perf_counter() - t0

    async def frame(self) -> None:
        async def one(engine: EngineEndpoint) -> None:
            for path in FRAME:
                await self.api.post(engine, path, {})

        await asyncio.gather(*(one(e) for e in self.engines))

    async def frame_packing(self) -> None:
        packing = asyncio.ensure_future(asyncio.to_thread(self.pack))
        t0 = time.perf_counter()
        await self.frame()
        self.samples.setdefault("frame_packing_wall", []).append(time.perf_counter() - t0)  # the frame alone
        self.samples.setdefault("pack_during_frame", []).append(await packing)

    async def block(self, repeats: int) -> None:
        call = lambda: self.api.post(self.engines[0], "/pause_generation", {})  # noqa: E731
        await timed(call, repeats, "call_wall", "call_cpu", self.samples)
        await timed(self.frame, max(repeats // 4, 2), "frame_wall", "frame_cpu", self.samples)
        for _ in range(max(repeats // 4, 2)):
            await self.frame_packing()
        self.samples.setdefault("pack_alone", []).extend(self.pack() for _ in range(2))

    def medians(self) -> dict[str, float]:
        return {key: statistics.median(values) for key, values in self.samples.items()}


async def run(args: argparse.Namespace, logs: Path) -> dict[str, dict[str, float]]:
    """Every contender kept open; `--rounds` rounds, each a block of every contender in turn (the order rotates
    each round), so a change of the machine's load falls on all of them alike; one warm-up round."""
    with receivers(2, logs) as engines:
        benches = {name: Bench(contender(name, 30.0), engines) for name in args.clients}
        try:
            per_round = max(args.repeats // args.rounds, 4)
            for index in range(args.rounds + 1):
                names = list(benches)
                names = names[index % len(names) :] + names[: index % len(names)]
                for name in names:
                    await benches[name].block(per_round)
                if index == 0:  # the warm-up round is dropped
                    for bench in benches.values():
                        bench.samples.clear()
            return {name: bench.medians() for name, bench in benches.items()}
        finally:
            for bench in benches.values():
                await bench.api.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=400, help="calls per contender in all")
    parser.add_argument("--rounds", type=int, default=20)
    default = [c for c in CLIENTS if c != "http11" or has_http11()]
    parser.add_argument("--clients", nargs="+", default=default, choices=CLIENTS)
    parser.add_argument("--out", type=Path, default=None, help="the result file (default: bench/results/...)")
    parser.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        serve(args.serve)
        return
    run_ = Run("http_roundtrip")
    with tempfile.TemporaryDirectory() as tmp:
        results = asyncio.run(run(args, Path(tmp)))
    for name, figures in results.items():
        print(f"{name:7s} " + ", ".join(f"{key} {value * 1e3:.2f} ms" for key, value in figures.items()))
    figures = {"repeats": args.repeats, "rounds": args.rounds, **results}
    run_.record(figures, summary(results), out=args.out, headline=headline(results))
    print(f"load average before {run_.load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}")


def summary(results: dict[str, dict[str, float]]) -> list[Row]:
    """DCS's engine client against the others: CPU per call, and an update's frame of calls."""
    rows = []
    ours = "engine" if "engine" in results else next(iter(results))
    a = results[ours]
    for other in (name for name in results if name != ours):
        b = results[other]
        rows.append(
            Row(
                what=f"one engine call: {ours} vs {other}",
                ours=f"{a['call_cpu'] * 1e3:.2f} ms CPU, {a['call_wall'] * 1e3:.2f} ms wall",
                compared=f"{other}: {b['call_cpu'] * 1e3:.2f} ms CPU, {b['call_wall'] * 1e3:.2f} ms wall",
                ratio=b["call_cpu"] / a["call_cpu"],
                ratio_text=f"{other} {(b['call_cpu'] - a['call_cpu']) * 1e3:+.2f} ms CPU per call",
            )
        )
        rows.append(
            Row(
                what=f"an update's frame on 2 engines (pause, begin, end, continue): {ours} vs {other}",
                ours=f"{a['frame_wall'] * 1e3:.1f} ms ({a['frame_packing_wall'] * 1e3:.1f} ms beside a 32 MiB pack)",
                compared=f"{other}: {b['frame_wall'] * 1e3:.1f} ms ({b['frame_packing_wall'] * 1e3:.1f} ms)",
                ratio=b["frame_wall"] / a["frame_wall"],
                ratio_text=f"{other} {b['frame_wall'] / a['frame_wall']:.2f}x the time",
            )
        )
    return rows


def headline(results: dict[str, dict[str, float]]) -> str:
    calls = (f"{name} {figures['call_cpu'] * 1e3:.2f} ms" for name, figures in results.items())
    return "CPU per engine call: " + ", ".join(calls)


if __name__ == "__main__":
    main()
