"""A shared host's other users against DCS's host-local files (docs/operations.md, Security): `nobody` stands in
for an unprivileged local user, next to a real `dcs coordinator` with a token, real `dcs worker` processes and
real Unix sockets.

- The host agent's socket: nobody cannot take its path (it lives in this user's private 0700 directory), and a
  process never sends its hello, which carries the token, to a socket whose peer is another uid (SO_PEERCRED).
- A memory-tier directory another user made first (mode 0777) is refused with a named error, never used.
- Sockets of killed workers do not pile up: the next worker removes them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from pydantic import SecretStr

from dcs_tasks.config import DCSConfig, RoleInfo
from dcs_tasks.coordinator_api import CoordinatorAPI
from dcs_tasks.hostagent import NodeLiveness, agent_socket_path
from tests.checkpoint_support import ckpt_config
from tests.helpers.localuser import NOBODY, Squatter, as_nobody, remove, shared_shm_dir
from tests.helpers.procs import CoordinatorProcess, WorkerProcess

pytestmark = pytest.mark.integration
TOKEN = "private-dirs-test-token"


@pytest.fixture
def coordinated(dcs_config: DCSConfig, tmp_path: Path) -> Iterator[DCSConfig]:
    """The test config with a token, and a real coordinator requiring it."""
    with_token = dcs_config.model_copy(update={"auth_token": SecretStr(TOKEN)})
    coordinator = CoordinatorProcess(with_token, tmp_path / "coordinator.log").start()
    try:
        yield with_token.model_copy(update={"coordinator_url": coordinator.url})
    finally:
        coordinator.stop()


async def _register_and_beat(config: DCSConfig, rank: int, seconds: float) -> NodeLiveness:
    """A trainer-like process of this host: registers (through the agent if one is usable) and keeps beating."""
    api = CoordinatorAPI(config.base_url, config.token(), timeout=10)
    liveness = NodeLiveness(api, config, RoleInfo(role_name="actor", rank=rank))
    try:
        await liveness.register()
        liveness.start()
        await asyncio.sleep(seconds)
        assert rank in (await api.topology()).nodes.get("actor", {}), "the node must stay registered and alive"
    finally:
        await liveness.stop()
        await api.aclose()
    return liveness


def _wait_for(check: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout}s")
        time.sleep(0.05)


def _sent_token(squatter: Squatter) -> bool:
    return any(TOKEN.encode() in data for data in squatter.received)


async def test_a_local_user_cannot_take_the_agents_socket(coordinated: DCSConfig, tmp_path: Path) -> None:
    """nobody tries to listen at the agent's default path before the worker starts (as during a restart). The
    path is in this user's private directory, so it cannot; the worker serves its agent there and processes
    beat through it. The token never reaches nobody. (Before: the path was in /dev/shm, nobody bound it, the
    worker logged that "another worker's agent serves" and processes sent their hello, token included, to
    nobody's socket.)"""
    path = agent_socket_path(coordinated)
    squatter = Squatter(path).start()
    worker = None
    try:
        worker = WorkerProcess(coordinated, tmp_path / "worker.log").start()
        liveness = await _register_and_beat(coordinated, 0, 3 * coordinated.heartbeat.interval_seconds)
        assert not _sent_token(squatter), f"the token reached a socket of uid {NOBODY} at {path}"
        assert b"".join(squatter.received) == b"" and squatter.bound is False
        assert liveness.via_agent or liveness.renewals > 0, "the worker's own agent serves the host"
        assert "another worker's agent serves" not in worker.log_tail()
    finally:
        squatter.stop()
        if worker is not None:
            worker.discard()


async def test_the_token_never_goes_to_an_agent_socket_of_another_uid(
    coordinated: DCSConfig, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An agent socket set to a directory another user controls (DCS_HOST_AGENT_SOCKET) where nobody listens:
    the client checks the listener's uid (SO_PEERCRED) before sending anything, warns naming the path and the
    uid, and beats per node itself; a worker refuses to serve there with the named problem instead of "another
    worker's agent serves". (Before: the hello with the token went to nobody's socket.)"""
    shared = shared_shm_dir(tmp_path, "squat")
    remove(shared)
    made = as_nobody("mkdir", "-m", "0755", str(shared))
    assert made.returncode == 0, made.stderr
    config = coordinated.model_copy(update={"host_agent_socket": shared / "agent.sock"})
    squatter = Squatter(shared / "agent.sock").start()
    worker = None
    try:
        assert squatter.bound
        with caplog.at_level(logging.WARNING, logger="dcs_tasks.hostagent"):
            liveness = await _register_and_beat(config, 1, 3 * config.heartbeat.interval_seconds)
        assert not _sent_token(squatter), f"the token reached a socket of uid {NOBODY}"
        assert b"".join(squatter.received) == b"", "not one byte goes to a socket of another uid"
        assert not liveness.via_agent
        assert any(f"uid {NOBODY}" in r.getMessage() and str(shared) in r.getMessage() for r in caplog.records)
        worker = WorkerProcess(config, tmp_path / "worker.log").start()
        started = worker
        _wait_for(lambda: "host agent" in started.log_tail(), "the worker's word on its agent")
        assert f"owned by uid {NOBODY}" in worker.log_tail(), worker.log_tail()
        assert "another worker's agent serves" not in worker.log_tail()
    finally:
        squatter.stop()
        if worker is not None:
            worker.discard()
        remove(shared)


def test_a_memory_dir_another_user_made_first_is_refused(dcs_config: DCSConfig, tmp_path: Path) -> None:
    """nobody makes the memory tier's directory first, mode 0777, and plants a step in it. The worker refuses to
    start and the trainer to open it, both naming the path, the owner and the fix; nothing is written there.
    (Before: the directory was used as it was: steps went into it, nobody could read, replace or delete them.)"""
    memory = shared_shm_dir(tmp_path, "mem")
    remove(memory)
    planted = memory / "run" / "step-000000001"
    for args in (("mkdir", "-m", "0777", str(memory)), ("mkdir", "-p", str(planted))):
        done = as_nobody(*args)
        assert done.returncode == 0, done.stderr
    config = ckpt_config(dcs_config, tmp_path, memory_tier_bytes=64 * 1024 * 1024, memory_dir=memory)
    worker = WorkerProcess(config, tmp_path / "worker.log")
    try:
        with pytest.raises(RuntimeError, match=rf"{memory} is owned by uid {NOBODY}.*DCS_MEMORY_DIR"):
            worker.start(timeout=60)
        from dcs_tasks.checkpoint import Checkpointer  # a trainer of this host opening the memory tier

        with pytest.raises(Exception, match=rf"{memory} is owned by uid {NOBODY}") as caught:
            Checkpointer("run", config).close()
        assert type(caught.value).__name__ == "UnsafeHostDirectory"
        assert sorted(p.name for p in memory.iterdir()) == ["run"]  # nothing of DCS's landed there
        assert os.stat(memory).st_uid == NOBODY and os.stat(memory).st_mode & 0o777 == 0o777  # nor was it adopted
    finally:
        worker.discard()  # one that started on the foreign directory (the finding) must not outlive the test
        remove(memory)


def _bound_then_dead(path: Path) -> None:
    """A socket file at `path` nobody listens on any more: what a killed worker leaves."""
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))
    dead.close()


def test_sockets_of_killed_workers_are_removed_by_the_next_worker(dcs_config: DCSConfig, tmp_path: Path) -> None:
    """A worker killed with SIGKILL leaves its agent's socket; the next worker of this user removes it (whatever
    its settings), and a worker configured like the killed one serves at the same path again. In the shared
    /dev/shm, stale agent sockets this uid left there are removed; another user's are left alone. (Before: they
    stayed, dozens after a test run.)"""
    first = dcs_config.model_copy(update={"namespace": "killed"})
    other = dcs_config.model_copy(update={"namespace": "next"})
    stale_path = agent_socket_path(first)
    legacy = Path("/dev/shm") / f"dcs-agent-test{os.getpid()}-{tmp_path.name[-12:]}.sock"
    foreign = legacy.with_name("dcs-agent-nobody-" + legacy.name.removeprefix("dcs-agent-"))
    _bound_then_dead(legacy)
    squatted = Squatter(foreign).start()  # nobody's socket in /dev/shm: not ours to remove
    workers: list[WorkerProcess] = []
    try:
        workers.append(WorkerProcess(first, tmp_path / "first.log").start())
        _wait_for(stale_path.exists, "the first worker's agent socket")
        workers[0].discard()  # SIGKILL: its agent had no chance to remove its socket
        assert stale_path.exists()
        workers.append(WorkerProcess(other, tmp_path / "next.log").start())
        _wait_for(agent_socket_path(other).exists, "the next worker's agent socket")
        assert not stale_path.exists(), f"the killed worker's socket {stale_path} is still there"
        assert not legacy.exists(), f"this uid's dead agent socket {legacy} is still in /dev/shm"
        assert foreign.exists(), "another user's socket must be left alone"
        workers.append(WorkerProcess(first, tmp_path / "again.log").start())
        _wait_for(stale_path.exists, "the agent of a worker configured like the killed one")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(2)
        probe.connect(str(stale_path))  # a live agent again
        probe.close()
        second = WorkerProcess(first, tmp_path / "second.log").start()  # configured alike, while that one serves
        workers.append(second)
        _wait_for(lambda: "host agent not started" in second.log_tail(), "the second worker's word on its agent")
        assert "another worker of this user serves" in second.log_tail()
        assert stale_path.exists()  # the serving agent's socket is left alone
    finally:
        squatted.stop()
        for worker in workers:  # the first one too, when the test fails before killing it
            worker.discard()
        legacy.unlink(missing_ok=True)


async def test_a_trusted_uid_is_talked_to_and_any_other_is_not(tmp_path: Path) -> None:
    """`DCS_HOST_TRUSTED_UID` names the one more uid whose agent a process talks to (a worker running as another
    user): its listener passes the SO_PEERCRED check; without it, the same listener gets nothing."""
    from dcs_tasks import hostdirs
    from dcs_tasks.hostagent import AgentUnusable, _Link

    shared = shared_shm_dir(tmp_path, "trusted")
    remove(shared)
    assert as_nobody("mkdir", "-m", "0700", str(shared)).returncode == 0
    listener = Squatter(shared / "agent.sock").start()
    try:
        assert listener.bound
        with pytest.raises(AgentUnusable, match=f"runs as uid {NOBODY}"):
            await _Link.open(listener.path, 1.0, hostdirs.allowed_uids(DCSConfig()))
        link = await _Link.open(listener.path, 1.0, hostdirs.allowed_uids(DCSConfig(host_trusted_uid=NOBODY)))
        await link._send(b"hello\n", 1.0)
        link.close()
        _wait_for(lambda: b"hello\n" in listener.received, "the trusted listener's line")
        assert b"".join(listener.received) == b"hello\n"  # the refused connection carried nothing
    finally:
        listener.stop()
        remove(shared)
