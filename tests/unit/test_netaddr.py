"""Advertised addresses, the gloo/NCCL interface and the loopback-master check (dcs_tasks.netaddr)."""

from __future__ import annotations

import os

import pytest

from dcs_tasks.errors import GroupInitError, LoopbackAddressError
from dcs_tasks.netaddr import (
    check_master_reachable,
    configure_comm_interface,
    interface_of,
    is_loopback,
    route_address,
)
from dcs_tasks.sync.receiver.cli import advertised_host, bind_host


def test_loopback_addresses_and_names() -> None:
    assert all(is_loopback(a) for a in ("127.0.0.1", "127.0.1.1", "::1", "localhost"))
    assert not any(is_loopback(a) for a in ("10.0.0.5", "0.0.0.0", "engine-3.cluster"))


def test_the_route_to_a_loopback_coordinator_is_loopback_and_an_unknown_host_falls_back() -> None:
    assert route_address("http://127.0.0.1:8000") == "127.0.0.1"
    assert route_address("http://no-such-host.invalid:8000", fallback="127.0.0.1") == "127.0.0.1"


def test_the_interface_holding_an_address() -> None:
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("203.0.113.77") is None  # TEST-NET-3: on no interface here
    assert interface_of("not an address") is None


def test_comm_interface_is_set_once_and_never_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    # these tests set variables every process started later inherits: they must be undone
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):  # set, then deleted: undone after the test
        monkeypatch.setenv(var, "-")  # (a bare delenv of an unset variable would not undo what the test sets)
        monkeypatch.delenv(var)
    assert configure_comm_interface("127.0.0.1") is None  # loopback: gloo's default works on one host
    assert "GLOO_SOCKET_IFNAME" not in os.environ
    assert configure_comm_interface("127.0.0.1", "lo") == "lo"
    assert os.environ["GLOO_SOCKET_IFNAME"] == os.environ["NCCL_SOCKET_IFNAME"] == "lo"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")  # the operator's own setting wins
    assert configure_comm_interface("127.0.0.1", "lo") == "eth7"


def test_comm_interface_follows_the_advertised_address(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):  # set, then deleted: undone after the test
        monkeypatch.setenv(var, "-")  # (a bare delenv of an unset variable would not undo what the test sets)
        monkeypatch.delenv(var)
    routed = route_address("http://192.0.2.10:80")  # the interface with the default route, if any
    if is_loopback(routed):
        pytest.skip("this machine has no route off loopback")
    assert configure_comm_interface(routed) == interface_of(routed) != "lo"


def test_a_loopback_master_with_a_remote_member_is_refused_naming_it() -> None:
    check_master_reachable("g", "127.0.0.1", [("rollout_0", "127.0.0.1"), ("rollout_1", "localhost")])
    check_master_reachable("g", "10.0.0.1", [("rollout_0", "10.0.0.2")])
    with pytest.raises(LoopbackAddressError, match=r"127\.0\.0\.1 is loopback but rollout_1 is at 10\.0\.0\.7") as err:
        check_master_reachable("g", "127.0.0.1", [("rollout_0", "127.0.0.1"), ("rollout_1", "10.0.0.7")])
    assert err.value.member == "rollout_1" and isinstance(err.value, GroupInitError)


def test_receiver_bind_and_advertise_are_separate() -> None:
    assert advertised_host("0.0.0.0", "10.0.0.5") == "10.0.0.5"
    assert advertised_host("10.0.0.5", None) == "10.0.0.5"
    assert advertised_host(None, None, "http://127.0.0.1:8000") == "127.0.0.1"
    assert bind_host(None, "127.0.0.1") == "127.0.0.1"
    assert bind_host(None, "203.0.113.77") == "0.0.0.0"  # advertised through NAT: not held here
    assert bind_host("0.0.0.0", "10.0.0.5") == "0.0.0.0"
    with pytest.raises(ValueError, match="--advertise-host"):
        advertised_host("0.0.0.0", None, "http://127.0.0.1:8000")
