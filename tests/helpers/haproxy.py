"""HAProxy (Debian's `haproxy` package) in front of coordinator replicas, as a process the test owns.

    proxy = HAProxy(HAProxyConfig(bind_address, port, [Backend("c1", a, 8000), Backend("c2", b, 8000)]))
    proxy.start()                                   # or proxy.start(launch=...) to run it inside a simulated host
    proxy.wait_states({"c1": "UP", "c2": "UP"})     # health checks (GET /healthz) passed
    proxy.url                                       # where clients go
    proxy.stop()

The config (`HAProxyConfig.render`) is the one docs/operations.md shows for coordinator replicas: a health
check on `/healthz` every `check_inter_ms` (down after `fall` failures, up after `rise` successes), server and
client timeouts above the longest weight-meta long-poll, and `retries` with `option redispatch 1`, so a
request whose connection to a dead coordinator fails is sent to another one. An admin socket answers
`show stat` (server states, current sessions per server).
"""

from __future__ import annotations

import contextlib
import csv
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

# The coordinator bounds one long-poll to 300 s (coordinator/routes/weight_meta.py MAX_WAIT_S) and the client
# waits `timeout` (30 s by default) on top: HAProxy must not cut a request that is still legitimately waiting.
LONGEST_REQUEST_S = 300 + 30


class Proc(Protocol):
    """A started process: what `HAProxy` needs of it (a `HostProcess` of tests/multihost/hosts.py is one)."""

    def alive(self) -> bool: ...

    def kill(self) -> None: ...

    def log_text(self) -> str: ...


Launcher = Callable[[Sequence[str], Path], Proc]


@dataclass(frozen=True)
class Backend:
    name: str
    address: str
    port: int


@dataclass(frozen=True)
class HAProxyConfig:
    bind_address: str
    bind_port: int
    backends: Sequence[Backend]
    stats_socket: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="dcs-haproxy-")) / "admin.sock")
    check_inter_ms: int = 500
    fall: int = 2
    rise: int = 1
    connect_timeout_ms: int = 1000
    request_timeout_s: int = LONGEST_REQUEST_S + 30  # `timeout server` and `timeout client`
    retries: int = 3
    maxconn: int = 4096
    log_requests: bool = True  # one line per request in the log (off for load tests)

    def render(self) -> str:
        servers = "\n".join(f"    server {b.name} {b.address}:{b.port} check" for b in self.backends)
        httplog = "option httplog" if self.log_requests else "option dontlog-normal"
        return f"""global
    maxconn {self.maxconn}
    log stderr format raw local0 info
    stats socket {self.stats_socket} mode 600 level admin

defaults
    mode http
    log global
    {httplog}
    timeout connect {self.connect_timeout_ms}ms
    timeout client {self.request_timeout_s}s
    timeout server {self.request_timeout_s}s
    timeout http-request 10s
    timeout http-keep-alive 10s
    timeout queue 5s
    retries {self.retries}
    option redispatch 1

frontend dcs_coordinator
    bind {self.bind_address}:{self.bind_port}
    default_backend coordinators

backend coordinators
    balance roundrobin
    option httpchk GET /healthz
    http-check expect status 200
    default-server inter {self.check_inter_ms}ms fall {self.fall} rise {self.rise}
{servers}
"""


class _LocalProc:
    def __init__(self, argv: Sequence[str], log_path: Path) -> None:
        self.log_path = log_path
        with log_path.open("ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def haproxy_binary() -> str:
    binary = shutil.which("haproxy") or ("/usr/sbin/haproxy" if Path("/usr/sbin/haproxy").exists() else None)
    if binary is None:
        raise RuntimeError("haproxy is not installed; `make test` installs it with apt (Debian package haproxy)")
    return binary


class HAProxy:
    """One HAProxy process with `config`, its files (config, log) in `workdir`."""

    def __init__(self, config: HAProxyConfig, workdir: Path) -> None:
        self.config = config
        self.workdir = workdir
        self.config_path = workdir / "haproxy.cfg"
        self.log_path = workdir / "haproxy.log"
        self.process: Proc | None = None

    @property
    def url(self) -> str:
        return f"http://{self.config.bind_address}:{self.config.bind_port}"

    def start(self, launch: Launcher | None = None, timeout: float = 15.0) -> HAProxy:
        """Write and check the config, start `haproxy -db` (foreground) with `launch` (default: a local process)
        and return once its admin socket and frontend answer."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(self.config.render())
        binary = haproxy_binary()
        check = subprocess.run([binary, "-c", "-f", str(self.config_path)], capture_output=True, text=True, timeout=30)
        if check.returncode != 0:
            raise RuntimeError(f"haproxy refused {self.config_path}: {check.stdout}{check.stderr}")
        argv = [binary, "-db", "-f", str(self.config_path)]
        self.process = (launch or _LocalProc)(argv, self.log_path)
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.server_states()
                socket.create_connection((self.config.bind_address, self.config.bind_port), timeout=0.5).close()
                return self
            except OSError:
                if not self.process.alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"haproxy did not start: {self.process.log_text()[-3000:]}") from None
                time.sleep(0.05)

    def admin(self, command: str) -> str:
        """One command on the admin socket (e.g. `show stat`, `disable server coordinators/c1`)."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(5)
            sock.connect(str(self.config.stats_socket))
            sock.sendall(command.encode() + b"\n")
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode()

    def stats(self) -> dict[str, dict[str, str]]:
        """`show stat` of the backend's servers: name -> columns (`status` UP/DOWN/..., `scur` sessions now)."""
        rows = csv.DictReader(self.admin("show stat").lstrip("# ").splitlines())
        return {row["svname"]: row for row in rows if row["pxname"] == "coordinators" and row["svname"] != "BACKEND"}

    def server_states(self) -> dict[str, str]:
        return {name: row["status"].split()[0] for name, row in self.stats().items()}

    def wait_states(self, want: dict[str, str], timeout: float = 15.0) -> None:
        """Until every server named in `want` has that state (health checks decide; e.g. UP, DOWN)."""
        deadline = time.monotonic() + timeout
        while True:
            states = self.server_states()
            if all(states.get(name) == state for name, state in want.items()):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"haproxy servers are {states}, not {want} after {timeout}s")
            time.sleep(0.05)

    def log_text(self) -> str:
        return self.process.log_text() if self.process is not None else ""

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
        with contextlib.suppress(OSError):
            self.config.stats_socket.unlink()
            self.config.stats_socket.parent.rmdir()
