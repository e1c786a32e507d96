"""Coordinator heartbeat throughput against a bare FastAPI endpoint doing one Redis SET, in the same run.

Starts a private redis-server (AOF on, appendfsync everysec), our coordinator (`dcs coordinator`, uvicorn,
one process) and a bare FastAPI app (uvicorn, one process, `SET key ts PX ttl` per request). A raw-asyncio
HTTP/1.1 keep-alive load generator drives `GET /heartbeat?role=actor&rank=i` (with the fencing header
`X-DCS-Node: ip:port` that CoordinatorAPI sends) on each with `--connections`
connections for `--duration` seconds; targets alternate for `--rounds` rounds so drift hits both alike.
Prints req/s, p50/p99 and the ratio ours/bare (median over rounds), plus each server's CPU time per request
(from /proc; steadier than req/s when other jobs share the cores); writes a result file under
bench/results/coordinator_load/.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.harness import (  # noqa: E402
    Row,
    Run,
    cpu_seconds,
    percentile,
    read_response,
    serve_bare,
    start_bare,
    start_coordinator,
    start_redis,
    stop,
)
from dcs_tasks.config import DCSConfig, RoleInfo  # noqa: E402

NODES = 64


# --- load generator ------------------------------------------------------------------------------
@dataclass
class RoundResult:
    target: str
    requests: int
    errors: int
    seconds: float
    rps: float
    p50_ms: float
    p99_ms: float
    server_cpu_us_per_req: float


async def _connection(port: int, conn_id: int, deadline: float, latencies: list[float], errors: list[int]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    i = conn_id
    try:
        while time.perf_counter() < deadline:
            rank = i % NODES
            i += 1
            node = f"X-DCS-Node: 127.0.0.1:{20000 + rank}"  # fenced, as CoordinatorAPI sends it (bare ignores it)
            request = f"GET /heartbeat?role=actor&rank={rank} HTTP/1.1\r\nHost: bench\r\n{node}\r\n\r\n".encode()
            start = time.perf_counter()
            writer.write(request)
            status = await read_response(reader)
            latencies.append(time.perf_counter() - start)
            if status != 200:
                errors.append(status)
    finally:
        writer.close()


async def drive(target: str, port: int, pid: int, connections: int, duration: float) -> RoundResult:
    latencies: list[float] = []
    errors: list[int] = []
    cpu_before = cpu_seconds(pid)
    start = time.perf_counter()
    deadline = start + duration
    await asyncio.gather(*[_connection(port, c, deadline, latencies, errors) for c in range(connections)])
    elapsed = time.perf_counter() - start
    cpu = cpu_seconds(pid) - cpu_before
    ordered = sorted(latencies)

    def pct(q: float) -> float:
        return percentile(ordered, q) * 1e3

    n = len(latencies)
    cpu_us = cpu / n * 1e6 if n else float("nan")
    return RoundResult(target, n, len(errors), elapsed, n / elapsed, pct(0.5), pct(0.99), cpu_us)


# --- orchestration -------------------------------------------------------------------------------
async def register_nodes(url: str) -> None:
    from dcs_tasks.coordinator_api import CoordinatorAPI

    async with CoordinatorAPI(url) as api:
        for rank in range(NODES):
            await api.register(RoleInfo(role_name="actor", rank=rank, port=20000 + rank))


async def run_rounds(ours: tuple[int, int], bare: tuple[int, int], args: argparse.Namespace) -> list[RoundResult]:
    """`ours`/`bare` are (port, server pid); rounds alternate bare, ours so that drift hits both alike."""
    for port, pid in (ours, bare):  # warm-up: connections, script cache, route caches
        await drive("warmup", port, pid, args.connections, args.warmup)
    results = []
    for _ in range(args.rounds):
        results.append(await drive("bare", *bare, args.connections, args.duration))
        results.append(await drive("ours", *ours, args.connections, args.duration))
    return results


def summarize(results: list[RoundResult], args: argparse.Namespace) -> dict[str, Any]:
    def med(target: str, field: str) -> float:
        return statistics.median(getattr(r, field) for r in results if r.target == target)

    pairs = list(zip(results[0::2], results[1::2], strict=True))
    ratios = [o.rps / b.rps for b, o in pairs]
    cpu_ratios = [b.server_cpu_us_per_req / o.server_cpu_us_per_req for b, o in pairs]
    return {
        "connections": args.connections,
        "duration_s": args.duration,
        "rounds": [asdict(r) for r in results],
        "ours": {"rps": med("ours", "rps"), "p50_ms": med("ours", "p50_ms"), "p99_ms": med("ours", "p99_ms")},
        "bare": {"rps": med("bare", "rps"), "p50_ms": med("bare", "p50_ms"), "p99_ms": med("bare", "p99_ms")},
        "ratio_ours_over_bare": statistics.median(ratios),
        "ratios_per_round": ratios,
        "cpu_efficiency_ratio": statistics.median(cpu_ratios),
        "cpu_efficiency_ratios_per_round": cpu_ratios,
        "ours_cpu_us_per_req": med("ours", "server_cpu_us_per_req"),
        "bare_cpu_us_per_req": med("bare", "server_cpu_us_per_req"),
        "errors": sum(r.errors for r in results),
        "target_ratio": 0.8,
    }


def summary_line(s: dict[str, Any], out: Path) -> str:
    o, b = s["ours"], s["bare"]
    return (
        f"coordinator heartbeats, {s['connections']} connections: "
        f"ours {o['rps']:.0f} req/s (p50 {o['p50_ms']:.2f} ms, p99 {o['p99_ms']:.2f} ms) | "
        f"bare FastAPI+SET {b['rps']:.0f} req/s (p50 {b['p50_ms']:.2f} ms, p99 {b['p99_ms']:.2f} ms) | "
        f"ratio ours/bare (median per round) {s['ratio_ours_over_bare']:.2f}x (target >= 0.8x) | "
        f"server CPU/req ours {s['ours_cpu_us_per_req']:.0f} us, bare {s['bare_cpu_us_per_req']:.0f} us "
        f"-> efficiency {s['cpu_efficiency_ratio']:.2f}x | errors {s['errors']} -> {out}"
    )


def main() -> None:
    bench_run = Run("coordinator_load")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per round and target")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--serve-bare", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--redis-url", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_bare:
        serve_bare(args.serve_bare, args.redis_url)
        return
    with tempfile.TemporaryDirectory() as tmp:
        redis_proc, redis_url = start_redis(Path(tmp))
        config = DCSConfig(redis_url=redis_url, enable_metrics=False)
        ours, ours_port = start_coordinator(config, Path(tmp) / "coordinator.log")
        bare, bare_port = start_bare(__file__, redis_url)
        try:
            asyncio.run(register_nodes(f"http://127.0.0.1:{ours_port}"))
            results = asyncio.run(run_rounds((ours_port, ours.pid), (bare_port, bare.pid), args))
        finally:
            for proc in (bare, ours, redis_proc):
                stop(proc)
    summary = summarize(results, args)
    o, b, ratio = summary["ours"], summary["bare"], summary["ratio_ours_over_bare"]
    row = Row(
        what=f"coordinator heartbeats, {args.connections} connections",
        ours=f"{o['rps']:.0f} req/s, p50 {o['p50_ms']:.1f} ms, p99 {o['p99_ms']:.1f} ms",
        compared=f"bare FastAPI endpoint doing one Redis SET: {b['rps']:.0f} req/s, p50 {b['p50_ms']:.1f} ms, "
        f"p99 {b['p99_ms']:.1f} ms",
        ratio=ratio,
        ratio_text=f"{ratio:.2f}x the bare endpoint (server CPU per request {summary['cpu_efficiency_ratio']:.2f}x)",
        target=">= 0.9x the bare endpoint",
        met=ratio >= 0.9,
    )
    out = bench_run.record(summary, [row], headline=f"{ratio:.2f}x a bare FastAPI + Redis SET endpoint")
    print(summary_line(summary, out.relative_to(REPO)))


if __name__ == "__main__":
    main()
