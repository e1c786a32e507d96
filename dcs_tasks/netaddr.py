"""Addresses for multi-host deployments: what a node advertises, which interface its collectives use.

- `route_address(url)`: the local address of the interface that routes to `url`'s host (a UDP `connect()` and
  `getsockname()`; no packet is sent). A node advertises this address (registration, a group's master address)
  unless told otherwise, so peers on other hosts can reach it.
- `configure_comm_interface(address, ifname)`: gloo and NCCL pick their own address from hostname resolution,
  which on many hosts gives loopback (`127.0.1.1 hostname` in /etc/hosts) and then no group across hosts
  forms. This sets `GLOO_SOCKET_IFNAME` / `NCCL_SOCKET_IFNAME` for the process (where not already set) to
  `ifname` (`DCS_COMM_IFNAME`), else to the interface holding the advertised address.
- `check_master_reachable(master, members)`: `LoopbackAddressError` when a group's master address is
  loopback while a member is on another address (it could never reach the master).
- `port_binds(address, port)`: whether a listener could bind there now (master ports; `dcs up`'s listeners).
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import socket
import struct
from collections.abc import Iterable
from urllib.parse import urlsplit

from dcs_tasks.errors import LoopbackAddressError

log = logging.getLogger(__name__)

COMM_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})
SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def is_loopback(address: str) -> bool:
    """True for 127.0.0.0/8, ::1 and the usual names of loopback."""
    if address.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def route_address(url: str, fallback: str = "127.0.0.1") -> str:
    """The local IPv4 address the kernel would use to reach `url`'s host (no packet is sent); `fallback`
    (with a warning) when the host cannot be resolved or there is no route to it."""
    parts = urlsplit(url if "//" in url else f"//{url}")
    host = parts.hostname or ""
    try:
        port = parts.port or 80
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, port))
            return str(probe.getsockname()[0])
    except (OSError, ValueError) as exc:
        log.warning("no route to %r (%s); advertising %s", host, exc, fallback)
        return fallback


def interface_of(address: str) -> str | None:
    """Name of the local interface holding IPv4 `address` (None when none does)."""
    try:
        wanted = socket.inet_aton(address)
    except OSError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on this interface
                continue
            if raw[20:24] == wanted:
                return name
    return None


def configure_comm_interface(address: str, ifname: str | None = None) -> str | None:
    """Set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME (each only where unset) to `ifname`, else to the interface
    of `address` when it is not loopback; returns the interface name gloo will use (None: gloo's default)."""
    chosen = ifname or (None if is_loopback(address) else interface_of(address))
    if chosen is None:
        if not is_loopback(address):
            log.warning("no local interface holds %s; gloo/NCCL resolve the hostname (set DCS_COMM_IFNAME)", address)
        return os.environ.get("GLOO_SOCKET_IFNAME")
    for var in COMM_IFNAME_VARS:
        inherited = os.environ.setdefault(var, chosen)
        if inherited != chosen:
            log.info("%s=%s was set before DCS; keeping it (DCS would use %s)", var, inherited, chosen)
    return os.environ["GLOO_SOCKET_IFNAME"]


def check_master_reachable(group: str, master_address: str, members: Iterable[tuple[str, str]]) -> None:
    """`LoopbackAddressError` when `master_address` is loopback and a member (node id, address) is not: that
    member could never reach the master, so the group would only time out."""
    if not is_loopback(master_address):
        return
    remote = [(node, ip) for node, ip in members if not is_loopback(ip)]
    if remote:
        node, ip = remote[0]
        raise LoopbackAddressError(
            f"group {group}: its master address {master_address} is loopback but {node} is at {ip}, another "
            "host, and cannot reach it; leave the client's ip= unset (it defaults to the address that routes "
            "to the coordinator) or set DCS_ADVERTISE_ADDRESS to this host's routable address",
            node,
        )


def port_binds(address: str, port: int) -> bool:
    """Whether a TCP listener could bind `address:port` now (no SO_REUSEADDR: TIME_WAIT counts as busy)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((address, port))
        except OSError:
            return False
    return True
