"""Simulated hosts on one machine: network, UTS and mount namespaces behind a private bridge.

Each `SimulatedHost` is a long-lived "host init" process (`sleep infinity`) started as

    ip netns exec NS unshare --uts --mount --propagation private sh -c 'hostname H; mount -t tmpfs tmpfs /dev/shm; ...'

so the host has its own network namespace (one veth, `eth0`, cabled to the bridge), its own hostname and its
own `/dev/shm`. Every other mount is the machine's, so all hosts see the checkpoint directory at the same path,
as a cluster file system would. Processes are started inside a host by `nsenter`ing the init's namespaces,
the way an operator would start them on that host (`dcs worker`); Python modules that import torch (a trainer
script, `dcs receiver`) are forked from the preloaded forkserver and enter the same namespaces themselves
(`spawn_python`, tests/multihost/inhost.py), so they skip torch's import and nothing else.

The bridge gets the first address of a /24 under 10.213.0.0/16 that no interface of the machine uses yet;
the hosts get .11, .12, ... The host namespaces have no default route, so their traffic never leaves the
bridge. Services the hosts share (Redis) listen on the bridge address in the root namespace.

Names carry the creating process's id in hex (`dmh<pid>b` bridge, `dmh<pid>v<i>` veths, `dcsmh-<pid>-<host>`
namespaces), so two sessions never clash and `sweep_stale()` removes what a killed session left behind.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from dcs_tasks.config import DCSConfig
from dcs_tasks.process import pid_alive
from tests.multihost.inhost import HostChild

SUBNET = "10.213"
LINK_PREFIX = "dmh"
NETNS_PREFIX = "dcsmh-"
HOST_INIT = 'hostname "$1" && mount -t tmpfs -o size=2g,mode=1777 tmpfs /dev/shm && echo ready && exec sleep infinity'


def unavailable_reason() -> str | None:
    """Why simulated hosts cannot be made here (None when they can)."""
    if os.geteuid() != 0:
        return "simulated hosts need root (network, UTS and mount namespaces, a bridge, tmpfs mounts)"
    missing = [tool for tool in ("ip", "unshare", "nsenter") if shutil.which(tool) is None]
    if missing:
        return f"simulated hosts need {', '.join(missing)} (iproute2, util-linux)"
    return None


def sh(*argv: str, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def _kill_netns_processes(netns: str) -> None:
    pids = sh("ip", "netns", "pids", netns, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def sweep_stale() -> list[str]:
    """Remove namespaces, veths and bridges left by sessions whose process is gone; returns their names."""
    removed: list[str] = []
    for netns in sh("ip", "netns", "list", check=False).stdout.split("\n"):
        match = re.match(rf"^{NETNS_PREFIX}([0-9a-f]+)-\S+", netns)
        if match and not pid_alive(int(match[1], 16)):
            name = match[0]
            _kill_netns_processes(name)
            sh("ip", "netns", "del", name, check=False)
            removed.append(name)
    links = re.findall(rf"^\d+: ({LINK_PREFIX}([0-9a-f]+)[bv]\d*)[@:]", sh("ip", "-o", "link").stdout, re.M)
    for name, owner in links:
        if not pid_alive(int(owner, 16)):
            sh("ip", "link", "del", name, check=False)
            removed.append(name)
    return removed


def _free_subnet() -> str:
    used = set(re.findall(rf"inet {re.escape(SUBNET)}\.(\d+)\.", sh("ip", "-o", "-4", "addr").stdout))
    for third in range(256):
        if str(third) not in used:
            return f"{SUBNET}.{third}"
    raise RuntimeError(f"every /24 of {SUBNET}.0.0/16 is in use on this machine")


class HostProcess:
    """A process started inside a simulated host (its own session, output to `log_path`)."""

    def __init__(self, host: SimulatedHost, proc: subprocess.Popen[bytes] | HostChild, log_path: Path) -> None:
        self.host = host
        self.proc = proc
        self.log_path = log_path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM, then kill -9 of its process group after `timeout`."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""


class SimulatedHost:
    """One host: its namespaces are held by an init process; `spawn` runs commands inside them."""

    def __init__(self, network: HostNetwork, name: str, index: int) -> None:
        self.network = network
        self.name = name
        self.netns = f"{NETNS_PREFIX}{network.session}-{name}"
        self.veth = f"{LINK_PREFIX}{network.session}v{index}"
        self.address = f"{network.prefix}.{10 + index}"
        self.init: subprocess.Popen[str] | None = None
        self.processes: list[HostProcess] = []

    def start(self, timeout: float = 15.0) -> SimulatedHost:
        sh("ip", "netns", "add", self.netns)
        sh("ip", "link", "add", self.veth, "type", "veth", "peer", "name", "eth0", "netns", self.netns)
        sh("ip", "link", "set", self.veth, "master", self.network.bridge, "up")
        sh("ip", "-n", self.netns, "addr", "add", f"{self.address}/24", "dev", "eth0")
        sh("ip", "-n", self.netns, "link", "set", "eth0", "up")
        sh("ip", "-n", self.netns, "link", "set", "lo", "up")
        unshare = ["unshare", "--uts", "--mount", "--propagation", "private"]
        argv = ["ip", "netns", "exec", self.netns, *unshare, "sh", "-c", HOST_INIT, "sh", self.name]
        self.init = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert self.init.stdout is not None
        ready, _, _ = select.select([self.init.stdout], [], [], timeout)
        if not ready or self.init.stdout.readline().strip() != "ready":
            self.init.kill()
            _, err = self.init.communicate(timeout=5)
            raise RuntimeError(f"host {self.name} did not start: {err.strip()}")
        return self

    @property
    def root(self) -> Path:
        """The host's file system view from the root namespace (`/proc/<init>/root`)."""
        assert self.init is not None
        return Path(f"/proc/{self.init.pid}/root")

    def shm_files(self) -> list[str]:
        """Names in this host's /dev/shm."""
        return sorted(os.listdir(self.root / "dev/shm"))

    def staging_files(self) -> list[str]:
        """Names in this host's default staging directory (`/dev/shm/dcs-<uid>/staging`: DCSConfig's default)."""
        staging = self.root / str(DCSConfig.default_runtime_dir() / "staging").lstrip("/")
        return sorted(os.listdir(staging)) if staging.is_dir() else []

    def command(self, argv: Sequence[str], cwd: Path) -> list[str]:
        """`argv` wrapped to run inside this host."""
        assert self.init is not None
        target = ["nsenter", f"--target={self.init.pid}", "--net", "--uts", "--mount", f"--wd={cwd}"]
        return [*target, "--", *argv]

    def spawn(
        self, argv: Sequence[str], env: dict[str, str], log_path: Path, cwd: Path, *, pipes: bool = False
    ) -> HostProcess:
        """Start `argv` inside this host in a new session, stderr to `log_path`; stdout too, or with `pipes`
        stdin and stdout are pipes (a driven process)."""
        with log_path.open("ab") as log:
            proc = subprocess.Popen(
                self.command(argv, cwd),
                env=env,
                stdin=subprocess.PIPE if pipes else subprocess.DEVNULL,
                stdout=subprocess.PIPE if pipes else log,
                stderr=log if pipes else subprocess.STDOUT,
                start_new_session=True,
            )
        process = HostProcess(self, proc, log_path)
        self.processes.append(process)
        return process

    def spawn_python(
        self, module: str, args: Sequence[str], env: dict[str, str], log_path: Path, cwd: Path, *, pipes: bool = False
    ) -> HostProcess:
        """`python -m module args` inside this host, forked from the preloaded forkserver (tests/multihost/inhost.py:
        torch and DCS already imported) instead of a fresh interpreter; otherwise as `spawn`: a new session, stderr
        to `log_path`, stdout too or, with `pipes`, stdin and stdout driven by the test."""
        assert self.init is not None
        proc = HostChild(self.init.pid, module, list(args), env, cwd, log_path, pipes)
        process = HostProcess(self, proc, log_path)
        self.processes.append(process)
        return process

    def run(self, argv: Sequence[str], cwd: Path, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Run `argv` inside this host to completion."""
        return subprocess.run(self.command(argv, cwd), capture_output=True, text=True, timeout=timeout, check=False)

    def use_hosts_file(self, text: str, workdir: Path) -> None:
        """Give this host its own /etc/hosts (`text`), bind-mounted in its mount namespace only: e.g. the
        common `127.0.1.1 <hostname>` line that makes the hostname resolve to loopback."""
        path = workdir / f"hosts-{self.name}"
        path.write_text(text)
        done = self.run(["mount", "--bind", str(path), "/etc/hosts"], cwd=workdir, timeout=10)
        if done.returncode != 0:
            raise RuntimeError(f"cannot bind-mount /etc/hosts in host {self.name}: {done.stderr.strip()}")

    def link_down(self) -> None:
        """Cut the host's cable: its bridge-side veth goes down (from the root namespace)."""
        sh("ip", "link", "set", self.veth, "down")

    def link_up(self) -> None:
        sh("ip", "link", "set", self.veth, "up")

    def destroy(self) -> None:
        """Kill everything in the host, then remove its namespace (which removes the veth pair)."""
        for process in self.processes:
            process.kill()
        _kill_netns_processes(self.netns)
        if self.init is not None:
            self.init.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.init.communicate(timeout=10)
        sh("ip", "netns", "del", self.netns, check=False)
        sh("ip", "link", "del", self.veth, check=False)


class HostNetwork:
    """The bridge and the hosts cabled to it. `create()` first; `destroy()` always (idempotent)."""

    def __init__(self) -> None:
        self.session = f"{os.getpid():x}"
        self.bridge = f"{LINK_PREFIX}{self.session}b"
        self.prefix = ""
        self.hosts: dict[str, SimulatedHost] = {}
        self._index = 0

    @property
    def gateway(self) -> str:
        """The bridge's address (root namespace): where shared services listen."""
        return f"{self.prefix}.1"

    def create(self) -> HostNetwork:
        sweep_stale()
        self.prefix = _free_subnet()
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        sh("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")
        return self

    def add_host(self, name: str) -> SimulatedHost:
        """A new host named `name` (its hostname), started and cabled to the bridge."""
        if name in self.hosts:
            raise ValueError(f"host {name!r} exists")
        self._index += 1
        host = SimulatedHost(self, name, self._index)
        self.hosts[name] = host
        try:
            return host.start()
        except BaseException:
            self.remove_host(name)
            raise

    def remove_host(self, name: str) -> None:
        host = self.hosts.pop(name, None)
        if host is not None:
            host.destroy()

    def wait_link(self, host: SimulatedHost, timeout: float = 10.0) -> None:
        """Until the host's veth carries traffic again (after `link_up`)."""
        deadline = time.monotonic() + timeout
        while "LOWER_UP" not in sh("ip", "-o", "link", "show", host.veth).stdout:
            if time.monotonic() > deadline:
                raise TimeoutError(f"link of {host.name} not up after {timeout}s")
            time.sleep(0.05)

    def destroy(self) -> None:
        for name in list(self.hosts):
            self.remove_host(name)
        sh("ip", "link", "del", self.bridge, check=False)
