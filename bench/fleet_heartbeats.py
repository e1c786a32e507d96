"""A fleet of simulated nodes against the coordinator: registration rate, heartbeat latency, server and Redis
CPU per heartbeat, Redis memory per node; 1 and 2 coordinator replicas side by side with the bare
FastAPI+SET endpoint, in one run, and a projection to `--project` nodes from the measured costs per node.

Starts a private redis-server (AOF everysec), `dcs coordinator` processes (with a token: auth is on) and the
bare app (bench/harness.py). Every simulated node is its own keep-alive connection beating every
`--interval` s, the nodes' phases spread uniformly (10,000 nodes at 5 s = 2,000 beats/s); `--long-polls`
connections long-poll /recv_weight_meta, woken by one /send_weight_meta per interval. Two replicas: two
coordinator processes on one Redis, the generator spreading its connections over both ports itself (no load
balancer in between, so the figures are the coordinators' own). Heartbeat modes:
  single  every node sends GET /heartbeat (fenced with X-DCS-Node), the per-node HTTP design
  batch   `--agents` host agents each beat their share of the nodes with one POST /heartbeats per interval
Registration: `--nodes` nodes with explicit ranks, one POST /register each over 64 connections; then (each
on a flushed Redis) the same without ranks (the coordinator assigns the smallest free one) and one
POST /register_batch per agent. CPU comes from /proc/<pid>/stat (utime+stime) of the
coordinator processes and of redis-server over the measured window, divided by the node beats answered in it.
Writes a result file under bench/results/fleet_heartbeats/ (bench/harness.py Run) and prints a summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import redis  # noqa: E402
from pydantic import SecretStr  # noqa: E402

from bench.harness import (  # noqa: E402
    Row,
    Run,
    command_line,
    cpu_seconds,
    percentile,
    read_answer,
    serve_bare,
    start_bare,
    start_coordinator,
    start_redis,
    stop,
)
from dcs_tasks.config import DCSConfig  # noqa: E402

TOKEN = "fleet-bench-token"
ROLE = "actor"
REGISTER_CONNECTIONS = 64


@dataclass
class Target:
    """Where a phase sends: the ports of the coordinators (or the bare app) and their processes' pids."""

    name: str
    ports: list[int]
    pids: list[int]
    redis_pid: int
    authorized: bool = True


@dataclass
class Phase:
    name: str
    nodes: int
    requests: int
    node_beats: int
    errors: int
    seconds: float
    beats_per_s: float
    p50_ms: float
    p99_ms: float
    server_cpu_us_per_beat: float
    redis_cpu_us_per_beat: float
    generator_cpu_share: float  # of one core: near 1.0 means the load generator, not the server, set the pace
    long_poll_errors: int
    first_long_poll_error: str


def identity(rank: int) -> str:
    return f"10.{rank // 65000}.0.1:{1024 + rank % 65000}"


def node_body(rank: int, explicit: bool = True) -> dict[str, Any]:
    """The /register body of node `rank` (without its rank when not `explicit`: the coordinator assigns one)."""
    ip = identity(rank).rpartition(":")[0]
    return {"role_name": ROLE, "rank": rank if explicit else None, "ip": ip, "port": 1024 + rank % 65000}


def http_request(method: str, path: str, body: bytes = b"", extra: str = "") -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: fleet\r\nAuthorization: Bearer {TOKEN}\r\n{extra}"
    if body:
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return (head + "\r\n").encode() + body


# --- load ----------------------------------------------------------------------------------------
@dataclass
class Window:
    """The measured part of a phase: beats sent in [start, end) count; the rest is warm-up and drain."""

    start: float
    end: float
    latencies: list[float]
    beats: int = 0
    errors: int = 0

    def record(self, sent: float, seconds: float, beats: int, ok: bool) -> None:
        """A request sent in the window: its latency counts either way, its beats only when answered."""
        if self.start <= sent < self.end:
            self.latencies.append(seconds)
            self.beats += beats if ok else 0
            self.errors += 0 if ok else 1


async def beat_loop(port: int, request: bytes, first: float, interval: float, window: Window, batch: int) -> None:
    """One connection beating at `first`, `first + interval`, ... until the window ends; a failed beat (an
    error answer, a connection closed or reset by an overloaded server) counts as an error and the node
    reconnects for its next beat."""
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, first - loop.time() - 0.5))
    conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
    at = first
    while at < window.end:
        await asyncio.sleep(max(0.0, at - loop.time()))
        sent = loop.time()
        try:
            conn = conn or await asyncio.open_connection("127.0.0.1", port)
            conn[1].write(request)
            status, body = await read_answer(conn[0])
            ok = status == 200 and (batch == 1 or body.count(b'"ok"') == batch + 1)  # + the top-level status
        except (OSError, asyncio.IncompleteReadError):
            conn, ok = None, False
        window.record(sent, loop.time() - sent, batch, ok)
        at += interval
    if conn is not None:
        conn[1].close()


async def long_poll(port: int, stop_at: float, errors: list[str]) -> None:
    """GET /recv_weight_meta with a wait, again from the answer's next_index, until `stop_at`; a failed poll is
    listed in `errors` and the poll starts over after a pause."""
    loop = asyncio.get_running_loop()
    index = -1
    while loop.time() < stop_at:
        wait = max(0.5, min(20.0, stop_at - loop.time()))
        query = "index=0&limit=0" if index < 0 else f"index={index}&wait_timeout_s={wait:.1f}"
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                while loop.time() < stop_at:
                    writer.write(http_request("GET", f"/recv_weight_meta?{query}"))
                    status, body = await read_answer(reader)
                    if status != 200:
                        raise RuntimeError(f"long-poll answered {status}: {body[:120]!r}")
                    answer = json.loads(body)
                    index = answer["end_index"] if index < 0 else answer["next_index"]
                    wait = max(0.5, min(20.0, stop_at - loop.time()))
                    query = f"index={index}&wait_timeout_s={wait:.1f}"
            finally:
                writer.close()
        except (OSError, asyncio.IncompleteReadError, RuntimeError) as exc:
            errors.append(str(exc)[:200])
            await asyncio.sleep(0.5)


async def appender(port: int, interval: float, stop_at: float) -> None:
    """One weight-meta entry per interval: wakes every long-poll."""
    loop = asyncio.get_running_loop()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = json.dumps({"names": ["w"], "dtypes": ["bfloat16"], "shapes": [[4096, 4096]], "group_name": "g"}).encode()
    try:
        while loop.time() < stop_at:
            await asyncio.sleep(interval)
            writer.write(http_request("POST", "/send_weight_meta", body))
            await read_answer(reader)
    finally:
        writer.close()


def beat_requests(target: Target, mode: str, nodes: int, agents: int) -> list[tuple[int, bytes, int]]:
    """(port, request, node beats in it) for every connection of the phase."""
    if mode == "single":
        out = []
        for rank in range(nodes):
            port = target.ports[rank % len(target.ports)]
            path = f"/heartbeat?role={ROLE}&rank={rank}"
            out.append((port, http_request("GET", path, extra=f"X-DCS-Node: {identity(rank)}\r\n"), 1))
        return out
    per = -(-nodes // agents)
    out = []
    for agent in range(agents):
        ranks = range(agent * per, min(nodes, (agent + 1) * per))
        beats = [{"role": ROLE, "rank": r, "identity": identity(r)} for r in ranks]
        request = http_request("POST", "/heartbeats", json.dumps({"beats": beats}).encode())
        out.append((target.ports[agent % len(target.ports)], request, len(ranks)))
    return out


async def run_phase(
    target: Target,
    mode: str,
    args: argparse.Namespace,
    *,
    nodes: int | None = None,
    long_polls: int | None = None,
    label: str = "",
) -> Phase:
    loop = asyncio.get_running_loop()
    nodes = args.nodes if nodes is None else nodes
    long_polls = args.long_polls if long_polls is None else long_polls
    conns = beat_requests(target, mode, nodes, args.agents)
    base = loop.time() + 1.0
    window = Window(base + args.interval, base + args.interval + args.measure, [])
    tasks = [
        beat_loop(port, request, base + args.interval * i / len(conns), args.interval, window, batch)
        for i, (port, request, batch) in enumerate(conns)
    ]
    poll_errors: list[str] = []
    if target.authorized and long_polls:
        polls_end = window.end + 0.5
        ports = [target.ports[i % len(target.ports)] for i in range(long_polls)]
        tasks += [long_poll(port, polls_end, poll_errors) for port in ports]
        tasks.append(appender(target.ports[0], args.interval, polls_end))
    cpu: dict[str, float] = {}

    async def sample() -> None:
        pids = [*target.pids, target.redis_pid, os.getpid()]
        await asyncio.sleep(window.start - loop.time())
        start = [cpu_seconds(p) for p in pids]
        await asyncio.sleep(window.end - loop.time())
        end = [cpu_seconds(p) for p in pids]
        cpu["server"] = sum(end[:-2]) - sum(start[:-2])
        cpu["redis"] = end[-2] - start[-2]
        cpu["generator"] = end[-1] - start[-1]

    await asyncio.gather(sample(), *tasks)
    ordered = sorted(window.latencies)
    beats = max(1, window.beats)
    return Phase(
        name=f"{target.name} {mode}{label}",
        nodes=nodes,
        requests=len(ordered),
        node_beats=window.beats,
        errors=window.errors,
        seconds=args.measure,
        beats_per_s=window.beats / args.measure,
        p50_ms=percentile(ordered, 0.5) * 1e3,
        p99_ms=percentile(ordered, 0.99) * 1e3,
        server_cpu_us_per_beat=cpu["server"] / beats * 1e6,
        redis_cpu_us_per_beat=cpu["redis"] / beats * 1e6,
        generator_cpu_share=cpu["generator"] / args.measure,
        long_poll_errors=len(poll_errors),
        first_long_poll_error=poll_errors[0] if poll_errors else "",
    )


# --- registration --------------------------------------------------------------------------------
async def register_single(ports: list[int], nodes: int, explicit: bool = True) -> float:
    """POST /register for every node over REGISTER_CONNECTIONS connections; returns registrations per second."""
    queue = list(range(nodes))
    start = time.perf_counter()

    async def worker(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while queue:
                rank = queue.pop()
                writer.write(http_request("POST", "/register", json.dumps(node_body(rank, explicit)).encode()))
                status, body = await read_answer(reader)
                if status != 200:
                    raise RuntimeError(f"/register answered {status}: {body[:300]!r}")
        finally:
            writer.close()

    await asyncio.gather(*[worker(ports[i % len(ports)]) for i in range(REGISTER_CONNECTIONS)])
    return nodes / (time.perf_counter() - start)


async def register_batches(ports: list[int], nodes: int, agents: int) -> float:
    """One POST /register_batch per agent (concurrently); returns registrations per second."""
    per = -(-nodes // agents)
    start = time.perf_counter()

    async def agent(i: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", ports[i % len(ports)])
        body = {"nodes": [node_body(r) for r in range(i * per, min(nodes, (i + 1) * per))]}
        try:
            writer.write(http_request("POST", "/register_batch", json.dumps(body).encode()))
            status, answer = await read_answer(reader)
            if status != 200:
                raise RuntimeError(f"/register_batch answered {status}: {answer[:300]!r}")
        finally:
            writer.close()

    await asyncio.gather(*[agent(i) for i in range(agents)])
    return nodes / (time.perf_counter() - start)


# --- orchestration -------------------------------------------------------------------------------
def redis_memory(client: redis.Redis) -> int:
    return int(client.info("memory")["used_memory"])


async def fleet(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    redis_proc, redis_url = start_redis(workdir)
    client = redis.Redis.from_url(redis_url)
    config = DCSConfig(redis_url=redis_url, enable_metrics=False, auth_token=SecretStr(TOKEN))
    procs = [redis_proc]
    load = {"before": os.getloadavg()}
    try:
        first, port1 = start_coordinator(config, workdir / "coordinator-1.log", args.coordinator_src)
        procs.append(first)
        bare, bare_port = start_bare(__file__, redis_url, workdir / "bare.log")
        procs.append(bare)
        one = Target("1 coordinator", [port1], [first.pid], redis_proc.pid)
        empty = redis_memory(client)
        reg: dict[str, float] = {"1 coordinator single": await register_single(one.ports, args.nodes)}
        per_node = (redis_memory(client) - empty) / args.nodes
        client.flushall()
        if args.registration == "all":
            reg["1 coordinator single, ranks assigned"] = await register_single(one.ports, args.nodes, explicit=False)
            client.flushall()  # the heartbeats below need node i at rank i
        modes = args.modes.split(",")
        if "batch" in modes:
            reg["1 coordinator batch"] = await register_batches(one.ports, args.nodes, args.agents)
        else:
            await register_single(one.ports, args.nodes)
        # the reference of this machine and this moment: the bare endpoint at a load it sustains anywhere
        bare_target = Target("bare FastAPI+SET", [bare_port], [bare.pid], redis_proc.pid, False)
        reference = await run_phase(
            bare_target, "single", args, nodes=round(args.bare_rate * args.interval), label=" ref"
        )
        phases = [reference]
        if "single" in modes:
            phases.append(await run_phase(bare_target, "single", args))
        for mode in modes:
            if mode == "batch" and args.long_polls:  # the beats' own cost, then the latency with the long-polls
                phases.append(await run_phase(one, mode, args, long_polls=0, label=", no long-polls"))
            phases.append(await run_phase(one, mode, args))
        if args.replicas == 2:
            second, port2 = start_coordinator(config, workdir / "coordinator-2.log", args.coordinator_src)
            procs.append(second)
            two = Target("2 coordinators", [port1, port2], [first.pid, second.pid], redis_proc.pid)
            client.flushall()
            reg["2 coordinators single"] = await register_single(two.ports, args.nodes)
            phases += [await run_phase(two, mode, args) for mode in modes]
    finally:
        for proc in reversed(procs):
            stop(proc)
    load["after"] = os.getloadavg()
    return summarize(args, phases, reg, per_node, load)


def project(phase: Phase, nodes: int, interval: float) -> dict[str, float]:
    beats_per_s = nodes / interval
    return {
        "beats_per_s": beats_per_s,
        "coordinator_cores": beats_per_s * phase.server_cpu_us_per_beat / 1e6,
        "redis_core_fraction": beats_per_s * phase.redis_cpu_us_per_beat / 1e6,
    }


def summarize(
    args: argparse.Namespace, phases: list[Phase], reg: dict[str, float], per_node: float, load: dict[str, Any]
) -> dict[str, Any]:
    ours = [p for p in phases if not p.name.startswith("bare")]
    ref = phases[0]  # the bare endpoint at --bare-rate: the same machine at the same moment
    ratios = {
        p.name: {
            "server_cpu_per_beat_to_bare_request": p.server_cpu_us_per_beat / ref.server_cpu_us_per_beat,
            "redis_cpu_per_beat_to_bare_request": p.redis_cpu_us_per_beat / ref.redis_cpu_us_per_beat,
            "p99_to_bare_p99": p.p99_ms / ref.p99_ms,
            "p50_to_bare_p50": p.p50_ms / ref.p50_ms,
        }
        for p in ours
    }
    return {
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores",
        "load_average_before": [round(x, 2) for x in load["before"]],
        "load_average_after": [round(x, 2) for x in load["after"]],
        "run_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "command": command_line(),
        "nodes": args.nodes,
        "interval_s": args.interval,
        "long_polls": args.long_polls,
        "agents": args.agents,
        "measure_s": args.measure,
        "bare_rate": args.bare_rate,
        "coordinator_src": str(args.coordinator_src),
        "replicas_2_via": "the generator spreads connections over both ports (no load balancer)",
        "phases": [asdict(p) for p in phases],
        "ratios_to_bare": ratios,
        "registrations_per_s": reg,
        "registration_seconds": {k: args.nodes / v for k, v in reg.items()},
        "redis_bytes_per_node": per_node,
        "projection": {
            "nodes": args.project,
            "redis_memory_mb": per_node * args.project / 2**20,
            "registration_seconds": {k: args.project / v for k, v in reg.items()},
            "per_phase": {p.name: project(p, args.project, args.interval) for p in ours},
        },
        "targets": {
            "server_cpu_us_per_beat": 20.0,
            "redis_cpu_us_per_beat": 10.0,
            "p99_to_bare_p99": 5.0,
            "registration_seconds_10k_batched": 2.0,
            "register_per_node_per_s": 2000.0,
        },
    }


def summary_lines(s: dict[str, Any], out: Path) -> list[str]:
    lines = [
        f"fleet: {s['nodes']} nodes beating every {s['interval_s']:g} s, {s['long_polls']} long-polls; load average "
        f"{s['load_average_before'][0]:.2f} before, {s['load_average_after'][0]:.2f} after"
    ]
    for p in s["phases"]:
        proj = s["projection"]["per_phase"].get(p["name"])
        cores = f", {s['projection']['nodes']} nodes -> {proj['coordinator_cores']:.2f} cores" if proj else ""
        lines.append(
            f"  {p['name']:<38} {p['beats_per_s']:6.0f} beats/s in {p['requests']:6d} req | p50 {p['p50_ms']:6.2f} ms "
            f"p99 {p['p99_ms']:7.2f} ms | server {p['server_cpu_us_per_beat']:6.1f} us/beat, redis "
            f"{p['redis_cpu_us_per_beat']:5.1f} us/beat | errors {p['errors']}, polls {p['long_poll_errors']}{cores}"
        )
    for name, r in s["ratios_to_bare"].items():
        lines.append(
            f"  {name:<38} to the bare endpoint: server CPU {r['server_cpu_per_beat_to_bare_request']:.3f}x, Redis "
            f"CPU {r['redis_cpu_per_beat_to_bare_request']:.3f}x per beat; p99 {r['p99_to_bare_p99']:.2f}x"
        )
    regs = ", ".join(f"{k} {v:.2f} s" for k, v in s["registration_seconds"].items())
    per_s = s["registrations_per_s"].get("1 coordinator single", 0.0)
    lines.append(f"  registering {s['nodes']}: {regs} (/register {per_s:.0f}/s)")
    lines.append(f"  Redis {s['redis_bytes_per_node']:.0f} B/node -> {out}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between a node's beats")
    parser.add_argument("--long-polls", type=int, default=300)
    parser.add_argument("--agents", type=int, default=100, help="host agents of the batch mode")
    parser.add_argument("--measure", type=float, default=10.0, help="measured seconds per phase (after warm-up)")
    parser.add_argument("--project", type=int, default=100_000, help="fleet size to project to")
    parser.add_argument("--coordinator-src", type=Path, default=REPO, help="source tree the coordinators run from")
    parser.add_argument("--modes", default="single,batch", help="heartbeat modes; 'single' for an older coordinator")
    parser.add_argument(
        "--bare-rate", type=float, default=200.0, help="requests/s of the bare reference phase (a load it sustains)"
    )
    parser.add_argument("--replicas", type=int, choices=(1, 2), default=2, help="2: also two coordinators")
    parser.add_argument(
        "--registration", choices=("all", "fast"), default="all", help="fast: skip the rank-less /register round"
    )
    parser.add_argument("--out", type=Path, default=None, help="result file (default: bench/results/fleet_heartbeats/)")
    parser.add_argument("--serve-bare", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--redis-url", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_bare:
        serve_bare(args.serve_bare, args.redis_url)
        return
    bench_run = Run("fleet_heartbeats")
    with tempfile.TemporaryDirectory() as tmp:
        summary = asyncio.run(fleet(args, Path(tmp)))
    rows, headline = summary_rows(summary)
    out = bench_run.record(summary, rows, notes=NOTES, out=args.out, headline=headline)
    print("\n".join(summary_lines(summary, out.relative_to(REPO) if out.is_relative_to(REPO) else out)))


NOTES = (
    "CPU per beat from /proc of the coordinator and redis-server over the measured window, divided by the node beats "
    "answered; the bare reference is the bare FastAPI+SET endpoint at --bare-rate requests/s in the same run (its CPU "
    "and p99 per request), so the ratios carry between machines better than the microseconds. The batch phase "
    "without long-polls gives the beats' own cost, the one with them the latency (and the long-polls' CPU counted "
    "per beat). Registration 'batch' is one POST /register_batch per host agent, as `dcs worker`'s agent sends them."
)


def summary_rows(s: dict[str, Any]) -> tuple[list[Row], str]:
    """The result file's rows (targets of issue 22, judged) and the README's headline."""
    phases = {p["name"]: p for p in s["phases"]}
    ref = s["phases"][0]
    own = phases.get("1 coordinator batch, no long-polls") or phases.get("1 coordinator batch")
    polled = phases.get("1 coordinator batch")
    if own is None or polled is None:
        return [], ""
    server, redis_us = own["server_cpu_us_per_beat"], own["redis_cpu_us_per_beat"]
    t = s["targets"]
    load = f"load {s['load_average_before'][0]:.1f} -> {s['load_average_after'][0]:.1f}"
    rows = [
        Row(
            what=f"coordinator CPU per beat ({s['agents']} agents, {s['nodes']:,} nodes every {s['interval_s']:g} s)",
            ours=f"{server:.1f} us ({polled['server_cpu_us_per_beat']:.1f} us with {s['long_polls']} long-polls)",
            compared=f"bare FastAPI+SET: {ref['server_cpu_us_per_beat']:.0f} us per request",
            ratio=server / ref["server_cpu_us_per_beat"],
            ratio_text=f"{server / ref['server_cpu_us_per_beat']:.3f}x a bare request",
            target=f"<= {t['server_cpu_us_per_beat']:g} us",
            met=server <= t["server_cpu_us_per_beat"],
        ),
        Row(
            what="Redis CPU per batched beat",
            ours=f"{redis_us:.1f} us",
            compared=f"bare FastAPI+SET: {ref['redis_cpu_us_per_beat']:.0f} us per SET",
            ratio=redis_us / ref["redis_cpu_us_per_beat"],
            ratio_text=f"{redis_us / ref['redis_cpu_us_per_beat']:.3f}x a bare SET",
            target=f"<= {t['redis_cpu_us_per_beat']:g} us",
            met=redis_us <= t["redis_cpu_us_per_beat"],
        ),
        Row(
            what=f"p99 of a batched request, {s['long_polls']} long-polls, {polled['beats_per_s']:.0f} beats/s",
            ours=f"{polled['p99_ms']:.1f} ms (p50 {polled['p50_ms']:.1f})",
            compared=f"bare FastAPI+SET at {s['bare_rate']:g}/s: p99 {ref['p99_ms']:.1f} ms",
            ratio=polled["p99_ms"] / ref["p99_ms"],
            ratio_text=f"{polled['p99_ms'] / ref['p99_ms']:.2f}x the bare p99",
            target=f"< {t['p99_to_bare_p99']:g}x the bare p99",
            met=polled["p99_ms"] / ref["p99_ms"] < t["p99_to_bare_p99"],
        ),
    ]
    reg = s["registration_seconds"]
    if "1 coordinator batch" in reg:
        rows.append(
            Row(
                what=f"registering {s['nodes']:,} nodes through {s['agents']} agents (POST /register_batch each)",
                ours=f"{reg['1 coordinator batch']:.2f} s",
                target=f"< {t['registration_seconds_10k_batched']:g} s",
                met=reg["1 coordinator batch"] < t["registration_seconds_10k_batched"],
            )
        )
    per_s = s["registrations_per_s"]["1 coordinator single"]
    rows.append(
        Row(
            what="POST /register per node, 64 connections, 1 coordinator",
            ours=f"{per_s:.0f}/s",
            target=f">= {t['register_per_node_per_s']:g}/s",
            met=per_s >= t["register_per_node_per_s"],
        )
    )
    headline = (
        f"{s['nodes']:,} nodes batched: {server:.0f} us coordinator, {redis_us:.0f} us Redis CPU per beat "
        f"({server / ref['server_cpu_us_per_beat']:.3f}x a bare request); p99 {polled['p99_ms'] / ref['p99_ms']:.1f}x "
        f"the bare endpoint's; {load}; `{s['command']}`"
    )
    return rows, headline


if __name__ == "__main__":
    main()
