"""Fixtures of the multi-host tests: one bridge per pytest session, a `Cluster` (Redis + hosts) per test.

Skipped, with the reason, where namespaces cannot be made (not root, no iproute2/util-linux, no CAP_NET_ADMIN).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.multihost.cluster import Cluster
from tests.multihost.hosts import HostNetwork, unavailable_reason


@pytest.fixture(scope="session")
def host_network() -> Iterator[HostNetwork]:
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    network = HostNetwork()
    try:
        network.create()
    except RuntimeError as exc:
        network.destroy()
        pytest.skip(f"cannot create a bridge for simulated hosts: {exc}")
    yield network
    network.destroy()


@pytest.fixture
def cluster(host_network: HostNetwork, tmp_path: Path) -> Iterator[Cluster]:
    cluster = Cluster(host_network, tmp_path)
    try:
        yield cluster
    finally:
        cluster.close()
