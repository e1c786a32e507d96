"""Hostile peers of the memory tier against real `dcs worker`s (their peer servers) over real sockets: a holder of
the shared token who pushes steps of a run and rank it does not hold, pushes more than the budget or huge
manifests, trickles a transfer, and a local user without the token who keeps connections open unauthenticated.
Host a's steps, which the hostile pushes replay, are committed in its memory by an in-process committer (`inline`,
the worker's code); the peer servers under attack are real workers'."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dcs_tasks import Checkpointer
from dcs_tasks.checkpoint.store.peers import channel as pc
from dcs_tasks.checkpoint.store.peers import stepfiles as ps
from dcs_tasks.checkpoint.store.peers import transfer as pw
from dcs_tasks.checkpoint.store.tiers import memdir, peerchoice
from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import PeerError, PeerRefused
from dcs_tasks.keys import Keys
from dcs_tasks.redisconn import sync_client
from tests.checkpoint_support import Inline, assert_same_state, start_worker, training_state, wait_until
from tests.helpers.procs import WorkerProcess
from tests.integration.test_checkpoint_memory_tier import TOKEN, host_config, memory_steps
from tests.unit.test_peerwire import make_step

pytestmark = pytest.mark.integration

MiB = 1 << 20
HANDSHAKE_SECONDS = 2.0  # peer_handshake_seconds of the idle-connections test
RATE_WINDOW_SECONDS = 3.0  # peer_rate_window_seconds of the trickling test (default 10)


def peer_address(config: DCSConfig, host: str) -> tuple[str, int]:
    """Where `host`'s worker serves its memory tier (its record in Redis), once it registered."""
    client = sync_client(config)
    try:
        found: dict[str, peerchoice.Peer] = {}

        def registered() -> bool:
            found.update(peerchoice.peers(client, Keys(config.redis.namespace)))
            return host in found

        wait_until(registered, 60, f"{host}'s peer server to register")
        return found[host].address, found[host].port
    finally:
        client.close()


def incoming(config: DCSConfig) -> list[Path]:
    """The partial copies (`.incoming-*`) under the host's memory directory. Walked with os.walk, which skips a
    directory removed while it walks (the peer server removes a cut copy's at any moment; `Path.rglob` raised
    FileNotFoundError on one in a CI run)."""
    found = []
    for parent, dirs, files in os.walk(config.host.memory_dir):
        found += [Path(parent) / name for name in dirs + files if name.startswith(ps.INCOMING_PREFIX)]
    return sorted(found)


def worker_peak_rss(worker: WorkerProcess) -> int:
    """The worker's main process (where the peer server runs): its peak resident set, bytes."""
    assert worker.proc is not None
    for line in Path(f"/proc/{worker.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_a_token_holder_cannot_push_steps_of_a_run_and_rank_it_does_not_hold(
    dcs_config: DCSConfig, tmp_path: Path
) -> None:
    """The trainer's own host refuses a pushed step of the trainer's run (before and after the trainer saved
    it), and a restore returns the trainer's own bytes."""
    a = host_config(dcs_config, tmp_path, "hosta", memory_replicas=0)
    worker = start_worker(a, tmp_path, name="worker-a")
    states = {s: training_state(seed=40 + s, width=128) for s in (1, 2)}
    try:
        address = peer_address(a, "hosta")
        forged = tmp_path / "forged"
        for step in (1, 2):
            step_dir, rel = make_step(forged, "victim", step, (4096,))
            if step == 2:  # pushed before the trainer saves step 2: it must not take the trainer's place
                with pytest.raises(PeerRefused, match="no host recorded committing it"):
                    pw.push_step(address, TOKEN, step_dir, rel, timeout=10)
        with Checkpointer("victim", a) as ckpt:
            ckpt.save(states[1], step=1).wait(timeout=120)
            step_dir, rel = make_step(forged / "again", "victim", 1, (4096,))
            with pytest.raises(PeerError):  # this host's own step: "have" before, never replaced; now refused
                if pw.push_step(address, TOKEN, step_dir, rel, timeout=10) == 0:
                    raise PeerRefused("the server said it has the step")
            ckpt.save(states[2], step=2).wait(timeout=120)
            assert memory_steps(a, "victim") == [1, 2]
            for step in (1, 2):
                restored = ckpt.restore(step=step)
                assert restored.location == "memory"
                assert_same_state(restored.state, states[step])
        # another run and rank nobody committed: refused too, and nothing of it is left in memory
        step_dir, rel = make_step(forged, "other", 7, (4096,), rank=3)
        with pytest.raises(PeerRefused, match="no host recorded committing it"):
            pw.push_step(address, TOKEN, step_dir, rel, timeout=10)
        assert not (Path(a.host.memory_dir) / "other").exists()
    finally:
        worker.discard()


def two_hosts(
    dcs_config: DCSConfig, tmp_path: Path, b_bytes: int, **b_settings: Any
) -> tuple[DCSConfig, DCSConfig, list[WorkerProcess]]:
    """Host a (holds the steps it commits, by `committed_steps_of_a`; no peer copies of its own) and host b (a
    memory tier of `b_bytes`, served by its real worker started with `b_settings` besides)."""
    a = host_config(dcs_config, tmp_path, "hosta", memory_replicas=0, memory_keep_last=8, memory_tier_bytes=256 * MiB)
    b = host_config(dcs_config, tmp_path, "hostb", memory_replicas=0, memory_tier_bytes=b_bytes, **b_settings)
    return a, b, [start_worker(b, tmp_path, name="worker-b")]


def committed_steps_of_a(a: DCSConfig, inline: Inline, count: int, width: int) -> list[tuple[Path, str]]:
    """`count` steps host a's trainer committed in its memory (by an in-process committer): (step directory, rel)."""
    with Checkpointer("budget", a, celery_app=inline(a)) as ckpt:
        for step in range(1, count + 1):
            ckpt.save(training_state(seed=step, width=width), step=step).wait(timeout=120)
    root = Path(a.host.memory_dir)
    return [(root / "budget" / ps.step_dir_name(s), f"budget/{ps.step_dir_name(s)}") for s in range(1, count + 1)]


def test_pushes_never_take_the_memory_tier_over_its_budget(
    dcs_config: DCSConfig, tmp_path: Path, inline: Inline
) -> None:
    budget = 8 * MiB
    a, b, workers = two_hosts(dcs_config, tmp_path, budget)
    try:
        steps = committed_steps_of_a(a, inline, 4, 512)  # ~3.2 MB each
        address = peer_address(b, "hostb")
        refused, held = 0, []
        for step_dir, rel in steps:  # host a's real steps, pushed as fast as they go
            try:
                pw.push_step(address, TOKEN, step_dir, rel, timeout=10)
            except PeerRefused as exc:
                assert "no room" in str(exc)
                refused += 1
            held.append(memdir.used_bytes(Path(b.host.memory_dir)))
        assert max(held) <= budget, f"host b held {held} bytes after each push, over its {budget}-byte budget"
        assert refused >= 1
        print(f"pushes: host b held at most {max(held)} bytes ({refused} of 4 refused)")
    finally:
        for worker in workers:
            worker.discard()


def test_huge_manifests_are_refused_unread(dcs_config: DCSConfig, tmp_path: Path) -> None:
    """Manifests count and are capped: 16 puts announcing 20 MiB manifests at once are refused before their
    bytes are read; the worker does not grow."""
    b = host_config(dcs_config, tmp_path, "hostb", memory_replicas=0)
    worker = start_worker(b, tmp_path, name="worker-b")
    try:
        address = peer_address(b, "hostb")
        rss = worker_peak_rss(worker)
        socks = []
        for _ in range(16):
            ch = pc.client_session(address, TOKEN, 10)
            ch.send({"op": "put", "rel": "budget/step-000000009"})
            ch.sock.sendall(struct.pack(">I", 20 * MiB) + bytes(32))
            socks.append(ch)
        blob = b'{"run":"budget","step":9,' + b" " * (20 * MiB - 40) + b"}"

        def stuff(ch: pc.Channel) -> None:
            try:
                ch.sock.sendall(blob)
            except OSError:
                pass  # the server refused and closed: that is the point

        threads = [threading.Thread(target=stuff, args=(ch,)) for ch in socks]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        time.sleep(1.0)
        grown = worker_peak_rss(worker) - rss
        for ch in socks:
            ch.sock.close()
        print(f"16 puts announcing 20 MiB manifests: the worker's peak RSS grew {grown >> 20} MiB")
        assert grown < 64 * MiB, f"the worker grew by {grown >> 20} MiB receiving 16 manifests of 20 MiB"
        assert incoming(b) == [] and not (Path(b.host.memory_dir) / "budget").exists()
    finally:
        worker.discard()


def test_a_trickling_transfer_is_cut_off_and_leaves_nothing(
    dcs_config: DCSConfig, tmp_path: Path, inline: Inline
) -> None:
    """Host b's worker (DCS_PEER_RATE_WINDOW_SECONDS=3 in its environment, the default minimum rate) cuts a put
    that sends one byte a second once its first window closes: not before 3 s, and well before the default
    window's 10 s."""
    a, b, workers = two_hosts(dcs_config, tmp_path, 64 * MiB, peer_rate_window_seconds=RATE_WINDOW_SECONDS)
    try:
        ((step_dir, rel),) = committed_steps_of_a(a, inline, 1, 256)
        address = peer_address(b, "hostb")
        ch = pc.client_session(address, TOKEN, 60)
        ch.send({"op": "put", "rel": rel})
        ch.send_blob((step_dir / "manifest.json").read_bytes())
        ch.reply("offering", "send")
        began, cut = time.monotonic(), None
        data = (step_dir / sorted(p.name for p in step_dir.glob("*.safetensors"))[0]).read_bytes()
        for i in range(40):  # one byte a second: forever at that pace
            try:
                ch.sock.sendall(data[i : i + 1])
            except OSError:
                cut = time.monotonic() - began
                break
            if i > 2 and not incoming(b):
                cut = time.monotonic() - began
                break
            time.sleep(1.0)
        ch.sock.close()
        assert cut is not None, "a transfer at 1 byte/s was still held after 40 s"
        # the worker's window started before `began` (it answered "send" first); the test looks once a second
        assert RATE_WINDOW_SECONDS - 0.5 <= cut < RATE_WINDOW_SECONDS + 5, f"cut off after {cut:.1f} s"
        print(f"a transfer at 1 byte/s cut off after {cut:.1f} s ({RATE_WINDOW_SECONDS:g} s window)")
        wait_until(lambda: incoming(b) == [], 10, "the partial copy to be removed")
        assert not (Path(b.host.memory_dir) / rel).exists()
    finally:
        for worker in workers:
            worker.discard()


def closed_by_peer(sock: socket.socket, deadline: float) -> bool:
    """Whether the server closes `sock` before `deadline` (what it sent first, the greeting, is read and dropped)."""
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            if not sock.recv(65536):
                return True
        except TimeoutError:
            return False
        except OSError:
            return True
    return False


@pytest.fixture
def idle_connections() -> Iterator[list[socket.socket]]:
    socks: list[socket.socket] = []
    yield socks
    for sock in socks:
        sock.close()


def test_idle_unauthenticated_connections_do_not_hold_the_peer_server(
    dcs_config: DCSConfig, tmp_path: Path, idle_connections: list[socket.socket]
) -> None:
    # a handshake deadline shorter than the default 5 s (the idle connections wait it out), still far longer
    # than a legitimate handshake takes on a loaded machine
    a = host_config(dcs_config, tmp_path, "hosta", memory_replicas=0, peer_handshake_seconds=HANDSHAKE_SECONDS)
    worker = start_worker(a, tmp_path, name="worker-a")
    try:
        address = peer_address(a, "hosta")
        for _ in range(16):  # a local user without the token, from another address, saying nothing
            sock = socket.socket()
            sock.bind(("127.0.0.2", 0))
            sock.connect(address)
            idle_connections.append(sock)
        began = time.monotonic()
        times = []
        for _ in range(10):
            start = time.monotonic()
            assert pw.list_steps(address, TOKEN, "anything", timeout=5) == []
            times.append(time.monotonic() - start)
        assert max(times) < 3 and time.monotonic() - began < 10, times
        # the idle ones are closed: at most 8 waited, and those no longer than the handshake deadline
        assert all(closed_by_peer(sock, began + HANDSHAKE_SECONDS + 3) for sock in idle_connections)
        print(f"10 legitimate calls beside 16 idle connections: slowest {max(times):.3f} s")
    finally:
        worker.discard()
