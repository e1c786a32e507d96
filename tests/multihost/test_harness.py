"""The simulated hosts themselves: what each host has of its own, what all share, a cut cable, and the sweep
of what a killed session left behind."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers.procs import REPO
from tests.multihost.cluster import Cluster
from tests.multihost.hosts import HostNetwork, SimulatedHost, sh, sweep_stale

pytestmark = [pytest.mark.multihost, pytest.mark.integration]


def ping_redis(cluster: Cluster, host: SimulatedHost) -> bool:
    """Whether a client inside `host` gets PONG from the cluster's Redis within 2 s."""
    code = (
        f"import redis; redis.Redis.from_url({cluster.redis.url!r}, socket_timeout=2, socket_connect_timeout=2).ping()"
    )
    return host.run([sys.executable, "-c", code], cwd=REPO, timeout=30).returncode == 0


def test_each_host_has_its_own_hostname_shm_and_network_and_all_share_the_checkpoint_dir(
    cluster: Cluster, tmp_path: Path
) -> None:
    a, b = cluster.add_host("ha"), cluster.add_host("hb")
    assert [h.run(["hostname"], cwd=tmp_path).stdout.strip() for h in (a, b)] == ["ha", "hb"]
    assert a.run(["sh", "-c", "echo x > /dev/shm/only-on-ha"], cwd=tmp_path).returncode == 0
    assert a.shm_files() == ["only-on-ha"] and b.shm_files() == []
    assert not Path("/dev/shm/only-on-ha").exists()
    shared = tmp_path / "shared"
    shared.mkdir()
    a.run(["sh", "-c", f"echo from-ha > {shared}/note"], cwd=tmp_path)
    assert b.run(["cat", f"{shared}/note"], cwd=tmp_path).stdout == "from-ha\n"
    assert f"inet {a.address}/24" in a.run(["ip", "-o", "-4", "addr", "show", "eth0"], cwd=tmp_path).stdout
    routes = a.run(["ip", "route"], cwd=tmp_path).stdout
    assert "default" not in routes and routes.startswith(f"{cluster.network.prefix}.0/24 dev eth0")
    assert ping_redis(cluster, a) and ping_redis(cluster, b)


def test_a_coordinator_on_one_host_answers_clients_on_another(cluster: Cluster) -> None:
    a, b = cluster.add_host("ha"), cluster.add_host("hb")
    url = cluster.start_coordinator(a)
    assert url == f"http://{a.address}:8000"
    code = f"import httpx; print(httpx.get({url + '/healthz'!r}, timeout=5).status_code)"
    assert b.run([sys.executable, "-c", code], cwd=REPO).stdout.strip() == "200"


def test_a_cut_link_isolates_only_that_host_until_it_returns(cluster: Cluster) -> None:
    a, b = cluster.add_host("ha"), cluster.add_host("hb")
    a.link_down()
    try:
        assert not ping_redis(cluster, a)
        assert ping_redis(cluster, b)
    finally:
        a.link_up()
    cluster.network.wait_link(a)
    # the host's ARP entry for Redis's host went FAILED while cut: the first connects may still say "no route"
    deadline = time.monotonic() + 15
    while not ping_redis(cluster, a):
        assert time.monotonic() < deadline, "host ha cannot reach Redis 15 s after its link returned"


KILLED_SESSION = """
import sys, time
from tests.multihost.hosts import HostNetwork
network = HostNetwork().create()
host = network.add_host("leftover")
print(network.bridge, host.netns, host.veth, host.init.pid, flush=True)
time.sleep(600)
"""


def test_the_sweep_removes_what_a_killed_session_left(host_network: HostNetwork, tmp_path: Path) -> None:
    session = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(KILLED_SESSION)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        assert session.stdout is not None
        bridge, netns, veth, init_pid = session.stdout.readline().split()
    finally:
        session.send_signal(signal.SIGKILL)  # no clean-up runs
        session.wait(10)
    assert netns in sh("ip", "netns", "list").stdout
    removed = sweep_stale()
    assert {netns, bridge} <= set(removed)  # the veth pair went with the namespace
    assert netns not in sh("ip", "netns", "list").stdout
    links = sh("ip", "-o", "link").stdout
    assert bridge not in links and veth not in links
    assert host_network.bridge in links  # a live session's bridge is left alone
    assert not running(int(init_pid))  # the host's processes are gone too


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie lingers until whoever adopted it reaps it)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "State:\tZ" not in status
