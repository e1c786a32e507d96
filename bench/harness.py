"""Pieces the benchmarks share: the result file of a run (`Run`, below), a private redis-server, `dcs coordinator`
and `dcs worker` processes, the bare FastAPI+SET comparison app, per-process CPU time from /proc, a raw HTTP/1.1
answer reader and percentiles. Benchmarks do not import tests/.

What `start_redis`, `start_coordinator`, `start_worker` and `start_bare` start does not outlive the benchmark:
the first of them has SIGTERM and SIGHUP raise `SystemExit(128 + signal)` in the main thread, and SIGINT
`KeyboardInterrupt` as Python's own handler does, so the script's `finally:` blocks run; at exit, whatever of
theirs is not `stop`ped yet is (newest first: the workers before the Redis they use). A second signal while that
runs kills them at once. A signal the benchmark started with ignored (SIGINT in a background job of a
non-interactive shell) stays ignored. Only SIGKILL of the benchmark still leaves them behind.
"""

from __future__ import annotations

import asyncio
import atexit
import datetime
import json
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dcs_tasks.config import DCSConfig
from dcs_tasks.keys import Keys

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
RESULT_FORMAT = 1


@dataclass
class Row:
    """One line of a benchmark's summary, as docs/benchmarks.md's table shows it (bench/report.py): what was
    measured, DCS's figure, the contender's in the same run, the ratio (DCS against it, > 1 better unless the
    text says otherwise) and the target with whether it was met (None: no target, or not judged)."""

    what: str
    ours: str
    compared: str = ""
    ratio: float | None = None
    ratio_text: str = ""
    target: str = ""
    met: bool | None = None


@dataclass
class Run:
    """A benchmark run: started when made (date, load average); `record` writes its result file,
    bench/results/<benchmark>/<UTC start>.json: the command, when, the machine and its load average before and
    after, the commit, every figure the script measured (`figures`, its own layout) and the summary rows."""

    benchmark: str
    started: datetime.datetime = field(default_factory=lambda: datetime.datetime.now(datetime.UTC))
    load_before: tuple[float, float, float] = field(default_factory=os.getloadavg)
    command: str = field(default_factory=lambda: command_line())

    def record(
        self, figures: Any, rows: list[Row] | None = None, notes: str = "", out: Path | None = None, headline: str = ""
    ) -> Path:
        """Write the result file; `headline`: the README's one short line for this run (the rows' ratios when empty)."""
        ended = datetime.datetime.now(datetime.UTC)
        document = {
            "format": RESULT_FORMAT,
            "benchmark": self.benchmark,
            "command": self.command,
            "started": _iso(self.started),
            "ended": _iso(ended),
            "machine": machine(self.load_before),
            "commit": git_commit(),
            "headline": headline,
            "summary": [asdict(row) for row in rows or []],
            "notes": notes,
            "figures": figures,
        }
        stamp = self.started.strftime("%Y%m%dT%H%M%SZ")
        path = out if out is not None else RESULTS / self.benchmark / f"{stamp}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(document, indent=1, default=str) + "\n")
        print(f"result: {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")
        return path


def command_line() -> str:
    """This process's command as one would type it from the repository root (`python bench/x.py --flag`)."""
    argv = list(sys.argv)
    if argv and Path(argv[0]).is_absolute() and Path(argv[0]).is_relative_to(REPO):
        argv[0] = str(Path(argv[0]).relative_to(REPO))
    return shlex.join(["python", *argv])


def machine(load_before: tuple[float, float, float]) -> dict[str, Any]:
    return {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": getattr(sys.modules.get("torch"), "__version__", None),
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in os.getloadavg()],
    }


def git_commit() -> dict[str, Any]:
    """HEAD and whether tracked files differ from it (the working tree is shared; a dirty tree is common)."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        status = ["git", "status", "--porcelain", "--untracked-files=no"]
        dirty = subprocess.run(status, cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return {"head": None, "dirty": None}
    return {"head": head.stdout.strip() or None, "dirty": bool(dirty.stdout.strip())}


def _iso(moment: datetime.datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for_port(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc), immune to how busy the rest of the machine is."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU of a process and its descendants (live ones, and the waited-for dead ones), /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        children = [int(c) for t in Path(f"/proc/{pid}/task").iterdir() for c in (t / "children").read_text().split()]
    except (OSError, ValueError):
        return 0.0
    own = sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    return own + sum(tree_cpu_seconds(child) for child in children)


def percentile(ordered: list[float], q: float) -> float:
    """The q-quantile of an already sorted list (nan when empty)."""
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


# --- the benchmark's processes: stopped when it ends ------------------------------------------------------------
_RUNNING: list[subprocess.Popen[bytes]] = []  # started here, not stopped yet (oldest first)
_SESSIONS: set[int] = set()  # of those, the ones leading a session of their own (a worker and its pool)
_signals: list[int] = []  # the signals received (SIGTERM, SIGHUP, SIGINT)
_owner = 0  # the pid that installed the handlers: a forked child of the benchmark leaves its processes alone


def _on_signal(signum: int, frame: object) -> None:
    """The first signal: raised in the main thread (so `finally:` blocks stop what they started); any later one
    while that runs: kill -9 what is still running, then raise again."""
    if os.getpid() != _owner:  # a fork of the benchmark: the signal's default action
        signal.signal(signum, signal.SIG_DFL if signum != signal.SIGINT else signal.default_int_handler)
        os.kill(os.getpid(), signum)
        return
    _signals.append(signum)
    name = signal.Signals(signum).name
    if len(_signals) > 1:
        print(f"bench: {name} again: killing its processes", file=sys.stderr, flush=True)
        for proc in list(_RUNNING):
            _kill(proc)
    else:
        print(f"bench: {name}: stopping its processes", file=sys.stderr, flush=True)
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + signum)


def _adopt(proc: subprocess.Popen[bytes], session: bool = False) -> subprocess.Popen[bytes]:
    """Stop `proc` when the benchmark ends, however it ends but SIGKILL (module doc)."""
    global _owner
    if not _owner:
        _owner = os.getpid()
        atexit.register(_stop_running)
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
                if signal.getsignal(sig) in (signal.SIG_DFL, signal.default_int_handler):
                    signal.signal(sig, _on_signal)
    _RUNNING.append(proc)
    if session:
        _SESSIONS.add(proc.pid)
    return proc


def _stop_running() -> None:
    """At exit: stop what is still running, newest first."""
    if os.getpid() != _owner:
        return
    for proc in reversed(list(_RUNNING)):
        stop(proc)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """kill -9 of `proc` (of its whole process group when it leads a session: a worker's pool too)."""
    try:
        if proc.pid in _SESSIONS and proc.returncode is None:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
    except ProcessLookupError:
        pass


def start_redis(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A private redis-server as production runs it (AOF on, appendfsync everysec, no eviction), in a session of
    its own: a Ctrl-C at the terminal reaches the benchmark alone, which stops its workers before this Redis."""
    port = free_port()
    args = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir), "--appendonly", "yes",
            "--appendfsync", "everysec", "--save", "", "--maxmemory-policy", "noeviction",
            "--logfile", str(workdir / "redis.log")]  # fmt: skip
    proc = _adopt(subprocess.Popen(args, start_new_session=True), session=True)
    wait_for_port(port)
    return proc, f"redis://127.0.0.1:{port}/0"


def start_coordinator(config: DCSConfig, log_path: Path, src: Path = REPO) -> tuple[subprocess.Popen[bytes], int]:
    """`dcs coordinator` (the real CLI, uvicorn) on a free loopback port, from the source tree `src` (another
    checkout: a before/after comparison); returns the process and its port."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DCS_")}
    env.update(config.model_copy(update={"coordinator_port": port, "coordinator_host": "127.0.0.1"}).to_env())
    env["PYTHONPATH"] = str(src) + os.pathsep + env.get("PYTHONPATH", "")
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dcs_tasks.cli.main", "coordinator"], env=env, stdout=log, stderr=log, cwd=src
        )
    _adopt(proc)
    wait_for_port(port)
    return proc, port


def start_worker(config: DCSConfig, log_path: Path, concurrency: int, timeout: float = 60.0) -> subprocess.Popen[bytes]:
    """`dcs worker` (the real CLI, prefork pool of `concurrency`) for `config`, in its own session; returns once
    its node queue's presence key is in Redis. Stop it with `stop` (SIGTERM: a warm shutdown)."""
    from dcs_tasks.celery_app import node_queue
    from dcs_tasks.redisconn import sync_client

    env = {k: v for k, v in os.environ.items() if not k.startswith("DCS_")}
    env.update(config.to_env())
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "dcs_tasks.cli.main", "worker", f"--concurrency={concurrency}", "--loglevel=INFO"]
    with log_path.open("ab") as log:
        proc = _adopt(subprocess.Popen(cmd, env=env, stdout=log, stderr=log, cwd=REPO, start_new_session=True), True)
    client = sync_client(config)
    key = Keys(config.redis.namespace).worker_presence(node_queue(config.host_name))
    deadline = time.monotonic() + timeout
    while not client.exists(key):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            raise RuntimeError(f"dcs worker not ready (exit {proc.returncode}); see {log_path}")
        time.sleep(0.1)
    return proc


def start_bare(script: str, redis_url: str, log_path: Path | None = None) -> tuple[subprocess.Popen[bytes], int]:
    """The bare comparison app in its own process: `script --serve-bare PORT --redis-url URL` (see `serve_bare`),
    its output to `log_path` when given."""
    port = free_port()
    cmd = [sys.executable, script, "--serve-bare", str(port), "--redis-url", redis_url]
    if log_path is None:
        proc = subprocess.Popen(cmd)
    else:
        with log_path.open("ab") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=log)
    _adopt(proc)
    wait_for_port(port)
    return proc, port


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM (a worker: warm shutdown), then kill -9 (a worker: its pool too) after 10 s."""
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        _kill(proc)
        proc.wait(10)
    if proc in _RUNNING:
        _RUNNING.remove(proc)


def serve_bare(port: int, redis_url: str) -> None:
    """FastAPI + redis.asyncio with the coordinator's client settings; `GET /heartbeat?role&rank` does one
    `SET key ts PX ttl`: the floor an HTTP-per-heartbeat design on this stack can reach."""
    import uvicorn
    from fastapi import FastAPI

    from coordinator.app import make_redis

    config = DCSConfig(redis_url=redis_url)
    keys = Keys("bare")
    state: dict[str, object] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state["redis"] = make_redis(config)
        yield

    app = FastAPI(lifespan=lifespan)

    @app.get("/heartbeat")
    async def heartbeat(role: str, rank: int) -> dict[str, object]:
        now = time.time()
        await state["redis"].set(keys.heartbeat(role, rank), repr(now), px=30_000)  # type: ignore[attr-defined]
        return {"status": "ok", "timestamp": now}

    # keep-alive as the coordinator's default (20 s): uvicorn's 5 s would close nodes beating every 5 s
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, timeout_keep_alive=20)


async def read_response(reader: asyncio.StreamReader) -> int:
    """Read one HTTP/1.1 answer with a Content-Length body; returns its status."""
    return (await read_answer(reader))[0]


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """Read one HTTP/1.1 answer with a Content-Length body; returns its status and body."""
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    length = 0
    for line in head.split(b"\r\n"):
        if line[:15].lower() == b"content-length:":
            length = int(line[15:])
    return status, await reader.readexactly(length)
