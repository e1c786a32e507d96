"""Round trip of the trainer's calls to a rollout engine: the hand-written kept-alive client
(`dcs_tasks.http11`), httpx and aiohttp.

Two receiver apps as `dcs receiver` serves them (the same FastAPI app, guards and uvicorn options; no
coordinator), each in a process of its own on loopback. Timed from this process, through `EngineAPI` with
its kept-alive client (`fast`) and with it turned off (`httpx`), and through a kept-alive aiohttp session
doing what `EngineAPI.post` does (JSON body, the whole call bounded by its timeout, the answer read up to
1 MiB, JSON decoded, status judged; `aiohttp`):
  call             one POST /pause_generation: wall time and this thread's CPU time
  frame            an update's engine frame on both engines at once: per engine pause, begin, end, continue
  frame_packing    the same frame while a 32 MiB bucket of 300 tensors is packed in a worker thread (as
                   `BucketSender.send_fused` does), and how long that packing took meanwhile (`pack_alone`:
                   without the frame)
Medians of --repeats; the contenders are interleaved (each measured twice, the second kept); writes a
result file under bench/results/. Run it on an otherwise idle machine: the
figures are a few milliseconds, and any other load moves them.
"""

from __future__ import annotations

import argparse
import asyncio
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.harness import REPO, Row, Run, free_port, wait_for_port
from bench.weight_sync import make_state
from dcs_tasks.sync.engine_protocol import EngineAPI
from dcs_tasks.sync.models import EngineEndpoint
from dcs_tasks.sync.sender import BucketSender

CLIENTS = ("httpx", "fast", "aiohttp")
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
    from dcs_tasks.receiver.guard import secure_receiver_app
    from dcs_tasks.receiver.server import create_receiver_app
    from dcs_tasks.sync.receiving import WeightReceiver

    config = DCSConfig()
    info = RoleInfo(role_name="rollout", rank=0, ip="127.0.0.1", port=port, metadata={})
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind(("127.0.0.1", port))

    async def main() -> None:
        backend = DeviceDirectBackend(config.backend_type, info, timeout_seconds=30, group_init_timeout_seconds=30)
        app = create_receiver_app(WeightReceiver(backend))
        secure_receiver_app(app, config.token(), config.receiver_max_body_bytes)
        options = guarded_server_options(
            config.receiver_request_read_timeout_seconds, config.receiver_keep_alive_seconds
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


class AiohttpAPI:
    """`EngineAPI.post`'s work over one aiohttp session: keep-alive by aiohttp's connector (4 s, below
    uvicorn's 5 s idle close), the whole call bounded by `timeout`, at most 1 MiB of answer, JSON decoded."""

    MAX_BYTES = 1 << 20

    def __init__(self, timeout: float) -> None:
        import aiohttp

        self._aiohttp = aiohttp
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None

    async def post(self, engine: EngineEndpoint, path: str, body: dict[str, object]) -> str:
        if self._session is None:
            connector = self._aiohttp.TCPConnector(keepalive_timeout=4.0)
            self._session = self._aiohttp.ClientSession(
                connector=connector, timeout=self._timeout, auto_decompress=False
            )
        async with self._session.post(f"{engine.url}{path}", json=body) as response:
            data = await response.content.read(self.MAX_BYTES + 1)
            while len(data) <= self.MAX_BYTES and not response.content.at_eof():
                more = await response.content.read(self.MAX_BYTES + 1 - len(data))
                if not more:
                    break
                data += more
            if len(data) > self.MAX_BYTES:
                raise RuntimeError("answer too large")
        answer = json.loads(data) if data else {}
        if response.status >= 400 or answer.get("success") is False:
            raise RuntimeError(f"{path} refused ({response.status})")
        return str(answer.get("message", ""))

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


async def timed(call: Callable[[], Awaitable[object]], repeats: int) -> tuple[float, float]:
    """Median wall and this thread's CPU seconds of `call`, after a few warm-ups."""
    for _ in range(5):
        await call()
    walls, cpus = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.thread_time()
        await call()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.thread_time() - c0)
    return statistics.median(walls), statistics.median(cpus)


async def measure(api: EngineAPI | AiohttpAPI, engines: list[EngineEndpoint], repeats: int) -> dict[str, float]:
    state = make_state(32, 300)
    sender = BucketSender(None, torch.device("cpu"), 256 * 1024 * 1024, sglang=True)  # type: ignore[arg-type]
    layout = sender.plan(state)[0]
    slot = sender._buffers([layout])[0]

    def pack() -> float:
        t0 = time.perf_counter()
        sender._pack(slot, layout, state, None)
        return time.perf_counter() - t0

    async def frame() -> None:
        async def one(engine: EngineEndpoint) -> None:
            for path in FRAME:
                await api.post(engine, path, {})

        await asyncio.gather(*(one(e) for e in engines))

    packs: list[float] = []
    frames: list[float] = []

    async def frame_packing() -> None:
        packing = asyncio.ensure_future(asyncio.to_thread(pack))
        t0 = time.perf_counter()
        await frame()
        frames.append(time.perf_counter() - t0)
        packs.append(await packing)

    out: dict[str, float] = {}
    out["call_wall"], out["call_cpu"] = await timed(lambda: api.post(engines[0], "/pause_generation", {}), repeats)
    out["frame_wall"], out["frame_cpu"] = await timed(frame, repeats)
    await timed(frame_packing, repeats)
    out["frame_packing_wall"] = statistics.median(frames[5:])  # the frame alone, not the wait for the pack
    out["pack_during_frame"] = statistics.median(packs[5:])
    out["pack_alone"] = statistics.median([pack() for _ in range(max(repeats // 4, 3))])
    return out


async def run(args: argparse.Namespace, logs: Path) -> dict[str, dict[str, float]]:
    results: dict[str, dict[str, float]] = {}
    with receivers(2, logs) as engines:
        for name in (*args.clients, *args.clients):  # twice each, interleaved; the second round is kept
            api: EngineAPI | AiohttpAPI = AiohttpAPI(30.0) if name == "aiohttp" else EngineAPI(None, 30.0)
            if name == "httpx" and isinstance(api, EngineAPI):
                api._fast = None
            try:
                results[name] = await measure(api, engines, args.repeats)
            finally:
                await api.aclose()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--clients", nargs="+", default=list(CLIENTS), choices=CLIENTS)
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
    run_.record({"repeats": args.repeats, **results}, summary(results), out=args.out)
    print(f"load average before {run_.load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}")


def summary(results: dict[str, dict[str, float]]) -> list[Row]:
    """The engine client in use (`fast` while http11 is kept) against the others, per call and per frame."""
    rows = []
    ours = "fast" if "fast" in results else next(iter(results))
    for other in (name for name in results if name != ours):
        a, b = results[ours], results[other]
        rows.append(
            Row(
                what=f"one engine call, {ours} vs {other} (CPU per call)",
                ours=f"{a['call_cpu'] * 1e3:.2f} ms CPU, {a['call_wall'] * 1e3:.2f} ms wall",
                compared=f"{other}: {b['call_cpu'] * 1e3:.2f} ms CPU, {b['call_wall'] * 1e3:.2f} ms wall",
                ratio=b["call_cpu"] / a["call_cpu"],
                ratio_text=f"{other} {(b['call_cpu'] - a['call_cpu']) * 1e3:+.2f} ms CPU per call",
                target="a library within 0.1 ms of CPU per call replaces the hand-written client",
                met=None,
            )
        )
        rows.append(
            Row(
                what=f"an update's frame on 2 engines (pause, begin, end, continue), {ours} vs {other}",
                ours=f"{a['frame_wall'] * 1e3:.2f} ms ({a['frame_packing_wall'] * 1e3:.2f} ms beside a 32 MiB pack)",
                compared=f"{other}: {b['frame_wall'] * 1e3:.2f} ms ({b['frame_packing_wall'] * 1e3:.2f} ms)",
                ratio=b["frame_wall"] / a["frame_wall"],
                ratio_text=f"{b['frame_wall'] / a['frame_wall']:.2f}x faster than {other}",
            )
        )
    return rows


if __name__ == "__main__":
    main()
