"""Free TCP ports on loopback.

`free_port()` gives ports above the kernel's ephemeral range (dcs_tasks/local/ports.py says why: a probed port
from that range can be taken by any outgoing connection before the test's server binds it), and each pytest
process of `make test` walks a part of its own, so two processes beside each other never hand out the same port
(their probes are not coordinated). Below that range the suite's ports are configured ones: master ports
11000-19999 (tests/helpers/testconfig.py), the seed snippets' 20000-20999 and tests/distributed's 24000-31999."""

from __future__ import annotations

import os
import socket
import time

from dcs_tasks.local.ports import PortPicker, listener_ports


def _own_part(ports: range) -> range:
    """This xdist worker's share of `ports` (all of them outside xdist)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "").removeprefix("gw")
    count = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not (worker.isdigit() and count.isdigit() and int(count) > 0):
        return ports
    share = len(ports) // int(count)
    start = ports.start + share * (int(worker) % int(count))
    return range(start, start + share)


free_port = PortPicker(_own_part(listener_ports()))


def wait_for_port(port: int, timeout: float = 10.0, host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout}s")
