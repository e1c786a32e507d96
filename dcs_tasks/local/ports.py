"""Free TCP ports for the listeners a local stack starts (`dcs up`, `dcs demo`): above the kernel's ephemeral
range.

A port is probed free and only later bound by the process it is for. A port from the ephemeral range
(32768-60999 on Linux by default; the kernel's choice for `bind(("127.0.0.1", 0))`) can meanwhile be taken by
any outgoing connection on the machine, which draws its local port from the same range: under load (a test
suite beside it) `dcs demo`'s receiver once failed with EADDRINUSE that way. Ports above the range are never
handed out by the kernel, so only another listener can take one, and a probe sees those. Each picker walks its
range from a random start, so the ports it gives before any is bound are distinct."""

from __future__ import annotations

import functools
import os
import random
import socket
import threading
from pathlib import Path

from dcs_tasks.netaddr import port_binds

PORT_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
HIGHEST_PORT = 65535
MIN_SPAN = 256  # fewer ports above the ephemeral range than this: the kernel's choice instead


def listener_ports(range_file: Path = PORT_RANGE_FILE) -> range:
    """The ports above the kernel's ephemeral range (empty where the range cannot be read or leaves fewer than
    MIN_SPAN above it)."""
    try:
        _, high = (int(part) for part in range_file.read_text().split())
    except (OSError, ValueError):
        return range(0)
    ports = range(high + 1, HIGHEST_PORT + 1)
    return ports if len(ports) >= MIN_SPAN else range(0)


def kernel_port(host: str = "127.0.0.1") -> int:
    """A port the kernel chose free on `host` (from its ephemeral range)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class PortPicker:
    """Free ports from `ports`, walked from a random start (distinct until the range wraps; a forked child starts
    afresh); the kernel's choice when `ports` is empty or every port of it is taken."""

    def __init__(self, ports: range) -> None:
        self.ports = ports
        self._restart()
        os.register_at_fork(after_in_child=self._restart)  # a forked child walks from a start of its own

    def _restart(self) -> None:
        self._cursor = random.randrange(len(self.ports)) if self.ports else 0
        self._lock = threading.Lock()

    def __call__(self, host: str = "127.0.0.1") -> int:
        with self._lock:
            for _ in range(len(self.ports)):
                port = self.ports[self._cursor % len(self.ports)]
                self._cursor += 1
                if port_binds(host, port):
                    return port
        return kernel_port(host)


@functools.cache
def _picker() -> PortPicker:
    return PortPicker(listener_ports())  # read when a port is first asked for, not at import


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now, above the kernel's ephemeral range where it has one."""
    return _picker()(host)
