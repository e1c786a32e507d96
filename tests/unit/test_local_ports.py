"""dcs_tasks/local/ports.py: the ports `dcs up` and `dcs demo` give their listeners lie above the kernel's
ephemeral range, are distinct until the range wraps, and skip a port something listens on."""

from __future__ import annotations

import socket
from pathlib import Path

from dcs_tasks.local.ports import MIN_SPAN, PortPicker, listener_ports
from dcs_tasks.netaddr import port_binds


def test_the_listener_ports_are_those_above_the_kernels_ephemeral_range(tmp_path: Path) -> None:
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("32768\t60999\n")
    assert listener_ports(ranges) == range(61000, 65536)
    ranges.write_text(f"1024\t{65535 - MIN_SPAN + 1}\n")  # too few left above it: the kernel's choice
    assert listener_ports(ranges) == range(0)
    ranges.write_text("garbage\n")
    assert listener_ports(ranges) == range(0)
    assert listener_ports(tmp_path / "missing") == range(0)


def _listening_socket(port: int = 0) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


def test_a_picker_skips_a_port_that_is_taken_and_falls_back_to_the_kernel_when_all_are() -> None:
    with _listening_socket() as taken:
        port = taken.getsockname()[1]
        assert not port_binds("127.0.0.1", port)
        picker = PortPicker(range(port, port + 1))  # only the taken port: the kernel's choice instead
        other = picker()
        assert other != port and port_binds("127.0.0.1", other)


def test_ports_picked_before_any_is_bound_are_distinct_and_in_range() -> None:
    ports = listener_ports() or range(40000, 41000)
    picker = PortPicker(ports)
    picked = [picker() for _ in range(50)]
    assert len(set(picked)) == 50 and all(p in ports for p in picked)
