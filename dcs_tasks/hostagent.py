"""The host agent's protocol and its client: how a DCS process registers and stays alive through its host's
`dcs worker` instead of beating the coordinator per node.

The agent (`workers/agent.py`, a thread of `dcs worker`'s main process) listens on a Unix socket,
`agent_socket_path(config)`: `DCS_HOST_AGENT_SOCKET`, default `<runtime_dir>/agent-<hash>.sock` (the user's
private directory, `dcs_tasks/hostdirs.py`, which the host's trainers and worker share and no other local user
can enter; the hash covers the coordinator URL, Redis URL, namespace and host name, so a process only meets an
agent configured like itself). The worker binds only in a directory that passes `hostdirs.check_private_dir`;
a client checks the agent's uid with SO_PEERCRED right after connecting and sends nothing (not the hello, which
carries the token) to a socket whose peer is not its own uid or `host_trusted_uid`.

One connection per node, JSON lines of at most `MAX_MESSAGE_BYTES`:

- hello (first line): `{"v": 1, "op": "register" | "adopt", "token": ..., "coordinator": <base_url>,
  "node": <RoleInfo>, "lease_ms": N, "identity": ...}`. `register` has the agent register the node (batched
  with the host's other registrations into one `POST /register_batch`); `adopt` hands it a node its process
  registered itself (a process that beat per node while no agent answered). An adopt is fenced as HTTP fences
  a beat, before it takes effect: one beat with the claimed `identity` (409 from the coordinator when another
  node holds the rank; a rank it does not know is taken); and a lease of the agent that its process still renews
  is never displaced by an adopt (409 from the agent). Answer: `{"ok": true, "rank", "node_id", "identity",
  "message"}`, or `{"ok": false, "status", "detail", "source": "agent" | "coordinator"}` and the connection is
  closed.
- `{"op": "renew"}`: the process's lease, renewed every `renew_every` seconds by the process's own event loop.
  Answer `{"ok": true, "identity": ...}` (the node's identity now: a re-registration may have changed an issued
  one), or 409 once another node took the rank over. Read each answer before renewing again: a connection that
  leaves more than 16 KiB of answers unread (beyond its socket's buffers) is cut off (its lease dropped).
- EOF (the process exited or was killed): the agent stops beating the node at once; it is gone from the
  topology one heartbeat timeout after its last beat, as a node that stops beating itself.

The agent beats, with one `POST /heartbeats` per interval, every node whose lease was renewed within its
`lease_ms`: a process that is alive but does not run (SIGSTOP, an event loop that does not turn) stops renewing
and drops out of the beats after at most `lease_ms`, so it is reported dead at most `lease_ms` later than if it
had beaten itself. When the agent does not answer (no worker, a killed or frozen worker), `NodeLiveness` beats
per node itself (`HeartbeatLoop`) and offers the node to an agent again every interval (`adopt`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import socket
import stat
import struct
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dcs_tasks import hostdirs
from dcs_tasks.aiotask import cancel_and_wait
from dcs_tasks.config import DCSConfig, RoleInfo
from dcs_tasks.coordinator_api import CoordinatorAPI
from dcs_tasks.errors import (
    AuthError,
    ClientClosed,
    CoordinatorError,
    CoordinatorUnavailable,
    DCSError,
    NodeNotFound,
    RankConflict,
)
from dcs_tasks.heartbeats import HeartbeatLoop
from dcs_tasks.models import IDENTITY_PATTERN, RegisterResponse

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 256 * 1024  # one JSON line: a registration's metadata is at most 64 KiB by default
MAX_SOCKET_PATH = 107  # sun_path is 108 bytes with its terminating NUL
RENEW_CAP_S = 1.0  # a process renews its lease every min(1 s, interval / 2) ...
LEASE_RENEWALS = 3  # ... and the lease lasts three renewals
MIN_LEASE_MS, MAX_LEASE_MS = 50, 600_000
CONNECT_TIMEOUT_S = 1.0
LEGACY_SOCKET_DIR = Path("/dev/shm")  # where agents listened before the runtime directory (`sweep_legacy_sockets`)
MAX_SWEPT = 4096  # sockets one sweep looks at
_CRED_SIZE = struct.calcsize("3i")  # struct ucred: pid, uid, gid
_warned_squatters: set[tuple[str, int]] = set()


class AgentUnusable(DCSError):
    """The host agent cannot be used (none listening, it broke the protocol, it serves another coordinator, it
    stopped answering): the process beats per node instead."""


def agent_socket_path(config: DCSConfig) -> Path:
    """Where this host's agent listens for processes configured like `config`."""
    if config.host.agent_socket is not None:
        return config.host.agent_socket
    scope = "\n".join((config.base_url, config.redis.url, config.redis.namespace, config.host_name))
    return hostdirs.runtime_path(config) / f"agent-{hashlib.sha256(scope.encode()).hexdigest()[:16]}.sock"


def lock_path(socket_path: Path) -> Path:
    """The lock an agent holds while it serves `socket_path`: a socket whose lock is free is a dead worker's."""
    return socket_path.with_name(socket_path.name + ".lock")


def sweep_stale_sockets(directory: Path) -> list[Path]:
    """Remove the agent sockets in `directory` (a checked private directory) that no live agent holds: those of
    workers that were killed (their lock is free). Returns those removed."""
    removed: list[Path] = []
    for path in sorted(directory.glob("agent-*.sock"))[:MAX_SWEPT]:
        fd = hostdirs.try_lock(lock_path(path))
        if fd is None:  # a live agent serves it
            continue
        try:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed.append(path)
            lock_path(path).unlink(missing_ok=True)  # while held: `try_lock` copes with a removed lock file
        finally:
            os.close(fd)
    return removed


def sweep_legacy_sockets(directory: Path = LEGACY_SOCKET_DIR) -> list[Path]:
    """Remove this uid's agent sockets in the shared `directory` (where agents listened before the runtime
    directory) that no agent answers any more. Another user's are never touched."""
    removed: list[Path] = []
    for path in sorted(directory.glob("dcs-agent-*.sock"))[:MAX_SWEPT]:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
            continue
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(CONNECT_TIMEOUT_S)
        try:
            probe.connect(str(path))
        except ConnectionRefusedError:  # nobody listens: the socket of a killed worker
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed.append(path)
        except OSError:
            pass
        finally:
            probe.close()
    return removed


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of the connected Unix socket `sock` (SO_PEERCRED)."""
    _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED_SIZE))
    return int(uid)


def renew_period(config: DCSConfig) -> float:
    return min(RENEW_CAP_S, config.heartbeat.interval_seconds / 2)


def answer_timeout(config: DCSConfig) -> float:
    """How long a process waits for the agent's answer to a renewal before beating itself: well inside the
    heartbeat timeout, so a frozen worker does not take its nodes down with it."""
    return min(5.0, max(0.25, config.heartbeat.timeout_seconds / 4))


class AgentHello(BaseModel):
    """The first line of a connection to the agent."""

    model_config = ConfigDict(extra="forbid")

    v: Literal[1]
    op: Literal["register", "adopt"]
    token: str | None = Field(default=None, max_length=4096)
    coordinator: str = Field(min_length=1, max_length=2048)
    node: RoleInfo
    lease_ms: int = Field(ge=MIN_LEASE_MS, le=MAX_LEASE_MS)
    identity: str = Field(default="", max_length=300, pattern=IDENTITY_PATTERN + "|^$")


class AgentRequest(BaseModel):
    """Every later line: a renewal."""

    model_config = ConfigDict(extra="forbid")

    op: Literal["renew"]


class AgentAnswer(BaseModel):
    model_config = ConfigDict(extra="forbid")

    ok: bool
    status: int = Field(default=200, ge=100, le=599)
    detail: str = Field(default="", max_length=4096)
    source: Literal["agent", "coordinator"] = "agent"
    rank: int | None = Field(default=None, ge=0)
    node_id: str = Field(default="", max_length=400)
    identity: str = Field(default="", max_length=300)
    message: str = Field(default="", max_length=400)


def encode(message: BaseModel | dict[str, Any]) -> bytes:
    data = message.model_dump_json(exclude_defaults=False) if isinstance(message, BaseModel) else json.dumps(message)
    return data.encode() + b"\n"


def raise_coordinator_error(status: int, detail: str) -> None:
    """The error `CoordinatorAPI` would have raised for the coordinator's answer the agent passes on."""
    if status == 409:
        raise RankConflict(detail, status)
    if status == 404:
        raise NodeNotFound(detail, status)
    if status == 401:
        raise AuthError(detail, status)
    if status in (502, 503, 504):
        raise CoordinatorUnavailable(detail, status)
    raise CoordinatorError(detail, status)


def _check_peer(path: Path, sock: socket.socket, uids: frozenset[int]) -> None:
    """AgentUnusable, before anything is sent, when the process at `path` runs as a uid not in `uids`: another
    local user squats the agent's path (warned once per path and uid)."""
    uid = peer_uid(sock)
    if uid in uids:
        return
    why = (
        f"the process listening at {path} runs as uid {uid}, not as this process's uid {os.geteuid()} (or "
        "DCS_HOST_TRUSTED_UID): nothing was sent to it (not the token); another local user may squat the host "
        "agent's path. Remove it, or set DCS_RUNTIME_DIR / DCS_HOST_AGENT_SOCKET to a directory of your own"
    )
    if (str(path), uid) not in _warned_squatters:
        _warned_squatters.add((str(path), uid))
        log.warning("host agent refused: %s", why)
    raise AgentUnusable(why)


class _Link:
    """One connection to the agent (one node)."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, sock: socket.socket, timeout: float
    ) -> None:
        self.reader = reader
        self.writer = writer  # read side only: every line is sent by `_send` on `sock`
        self.sock = sock
        self.timeout = timeout

    @classmethod
    async def open(cls, path: Path, timeout: float, uids: frozenset[int] | None = None) -> _Link:
        """A connection to the agent at `path`, once the process listening there proved to run as one of `uids`
        (SO_PEERCRED; default: this process's euid): nothing, the token least of all, is sent to a socket
        another local user made."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):  # not wait_for: it can swallow a cancel (aiotask.py)
                await asyncio.get_running_loop().sock_connect(sock, str(path))
            _check_peer(path, sock, uids if uids is not None else frozenset({os.geteuid()}))
            reader, writer = await asyncio.open_unix_connection(sock=sock, limit=MAX_MESSAGE_BYTES)
        except (OSError, TimeoutError, AgentUnusable) as exc:
            sock.close()
            if isinstance(exc, AgentUnusable):
                raise
            raise AgentUnusable(f"no host agent answers at {path}: {exc!r}") from exc
        return cls(reader, writer, sock, timeout)

    async def _send(self, line: bytes, timeout: float) -> None:
        """The line, sent with MSG_NOSIGNAL: when the agent is gone (its worker killed) this is EPIPE, never a
        SIGPIPE, which kills a process that set SIGPIPE's default action (a trainer script may, as `dcs ckpt`
        does for pipes). Lines are small; a full socket buffer is waited for in short sleeps, within `timeout`."""
        view = memoryview(line)
        deadline = time.monotonic() + timeout
        while view:
            try:
                view = view[self.sock.send(view, socket.MSG_NOSIGNAL) :]
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the host agent took no message for {timeout:g}s") from None
                await asyncio.sleep(0.005)

    async def ask(self, line: bytes, timeout: float | None = None) -> AgentAnswer:
        try:
            await self._send(line, timeout or self.timeout)
            async with asyncio.timeout(timeout or self.timeout):
                raw = await self.reader.readline()
        except (OSError, TimeoutError, ValueError) as exc:  # ValueError: a line over the limit
            raise AgentUnusable(f"the host agent did not answer: {exc!r}") from exc
        if not raw:
            raise AgentUnusable("the host agent closed the connection")
        try:
            return AgentAnswer.model_validate_json(raw)
        except ValidationError as exc:
            raise AgentUnusable(f"the host agent's answer is not an AgentAnswer: {str(exc)[:300]}") from exc

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


class NodeLiveness:
    """Register one node and keep it alive: through the host agent while one answers, else per node.

    `register()` then `start()` (a background task renewing the lease, or beating per node) or, for a caller
    that decides itself when the node is alive (`dcs engine attach` beats only while its engine answers),
    `beat_once()` every interval. `lost` holds the RankConflict once another node took the rank over.
    """

    def __init__(self, api: CoordinatorAPI, config: DCSConfig, info: RoleInfo, *, lease_s: float | None = None) -> None:
        self.api = api
        self.config = config
        self.info = info
        self.interval = config.heartbeat.interval_seconds
        self.renew_every = renew_period(config)
        self.lease_s = lease_s if lease_s is not None else LEASE_RENEWALS * self.renew_every
        self.path: Path | None = agent_socket_path(config) if config.host.agent else None
        self.lost: RankConflict | None = None
        self.renewals = 0
        self.fallbacks = 0  # times the agent stopped answering and the node beat per node
        self._link: _Link | None = None
        self._direct: HeartbeatLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._next_offer = 0.0

    @property
    def via_agent(self) -> bool:
        return self._link is not None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def predecessor_wait_s(self) -> float:
        """How long a restarted process waits for its rank while a predecessor that did not unregister still
        holds it: the coordinator frees the rank one heartbeat timeout after the last beat, and an agent keeps
        beating a frozen predecessor (alive, its event loop not turning, its agent link open) for up to its
        lease after its last renewal."""
        return self.config.heartbeat.timeout_seconds + self.interval + self.lease_s

    # --- registration --------------------------------------------------------------------------------
    async def register(self, wait_for_rank_s: float = 0.0) -> RegisterResponse:
        """Register through the agent when one answers (else directly); RankConflict after `wait_for_rank_s`
        as `CoordinatorAPI.register`."""
        deadline = time.monotonic() + wait_for_rank_s
        answer: RegisterResponse | None = None
        while self.path is not None:
            try:
                answer = await self._agent_hello("register")
                break
            except AgentUnusable as exc:
                log.info("%s registers itself: %s", self.info.role_name, exc)
                break
            except RankConflict:
                left = deadline - time.monotonic()
                if self.info.rank is None or left <= 0:
                    raise
                await asyncio.sleep(min(1.0, left))
        if answer is None:
            answer = await self.api.register(self.info, wait_for_rank_s=max(0.0, deadline - time.monotonic()))
            self._next_offer = time.monotonic() + self.interval
        self.info = self.info.model_copy(update={"rank": answer.rank})
        return answer

    async def _agent_hello(self, op: Literal["register", "adopt"]) -> RegisterResponse:
        assert self.path is not None
        link = await _Link.open(self.path, answer_timeout(self.config), hostdirs.allowed_uids(self.config))
        hello = AgentHello(
            v=PROTOCOL_VERSION,
            op=op,
            token=self.config.token(),
            coordinator=self.config.base_url,
            node=self.info,
            lease_ms=max(MIN_LEASE_MS, min(MAX_LEASE_MS, int(self.lease_s * 1000))),
            identity=self.api.identity_of(self.info.role_name, self.info.rank) if self.info.rank is not None else "",
        )
        # a registration waits for the coordinator (the agent retries it while unavailable)
        wait = self.config.coordinator.request_timeout_seconds + self.api.retry_for_s + 5 if op == "register" else None
        try:
            answer = await link.ask(encode(hello), wait)
            if not answer.ok:
                if answer.source == "coordinator":
                    raise_coordinator_error(answer.status, answer.detail)
                raise AgentUnusable(f"the host agent refused the node ({answer.status}): {answer.detail}")
            if answer.rank is None:
                raise AgentUnusable("the host agent's answer carries no rank")
        except BaseException:
            link.close()
            raise
        self._link = link
        self.api.remember_identity(self.info.role_name, answer.rank, answer.identity)
        return RegisterResponse(
            rank=answer.rank, node_id=answer.node_id, message=answer.message, identity=answer.identity
        )

    # --- keeping it alive ----------------------------------------------------------------------------
    def start(self) -> NodeLiveness:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"dcs-liveness-{self.info.node_id}")
        return self

    async def stop(self) -> None:
        """Stop renewing and beating (the node is not unregistered: its owner does that, fenced)."""
        task, self._task = self._task, None
        if task is not None:
            await cancel_and_wait(task)
        self._drop_link()
        if self._direct is not None:
            await self._direct.stop()
            self._direct = None

    def _drop_link(self) -> None:
        if self._link is not None:
            self._link.close()
            self._link = None

    async def _run(self) -> None:
        while self.lost is None:
            try:
                await self._step(background=True)
            except RankConflict as exc:
                self.lost = exc
                log.error("%s lost its rank, heartbeats stopped: %s", self.info.node_id, exc)
            except ClientClosed:
                log.info("heartbeats of %s stopped: the coordinator client was closed", self.info.node_id)
                return
            if self.lost is not None:
                break
            await asyncio.sleep(self.renew_every if self._link is not None else min(self.renew_every, self.interval))
        self._drop_link()
        if self._direct is not None:
            await self._direct.stop()

    async def beat_once(self) -> None:
        """One renewal through the agent, or one beat of its own when no agent answers. Raises RankConflict
        (the rank is another node's now) and, beating itself, CoordinatorError."""
        try:
            await self._step(background=False)
        except RankConflict as exc:
            self.lost = exc
            raise

    async def _step(self, background: bool) -> None:
        if self._link is None:
            await self._offer()
        if self._link is not None:
            try:
                answer = await self._link.ask(b'{"op":"renew"}\n')
            except AgentUnusable as exc:
                self._fall_back(exc)
            else:
                if not answer.ok:
                    self._drop_link()
                    if answer.status == 409:
                        raise RankConflict(answer.detail, 409)
                    self._fall_back(AgentUnusable(f"the agent refused a renewal ({answer.status}): {answer.detail}"))
                else:
                    assert self.info.rank is not None
                    self.api.remember_identity(self.info.role_name, self.info.rank, answer.identity)
                    self.renewals += 1
                    return
        if self._direct is None:
            self._direct = HeartbeatLoop(self.api, self.info, self.interval)
            if background:
                self._direct.start()
                return
        if background:
            if not self._direct.running and self._direct.lost is not None:
                raise self._direct.lost
            if not self._direct.running and self._task is not None:
                raise ClientClosed("the node's own heartbeats stopped")
            return
        await self._direct.beat_once()

    def _fall_back(self, why: AgentUnusable) -> None:
        self._drop_link()
        self.fallbacks += 1
        self._next_offer = time.monotonic() + self.interval
        log.warning("%s beats per node itself: %s", self.info.node_id, why)

    async def _offer(self) -> None:
        """Hand the node to an agent (every interval while none has it)."""
        if self.path is None or time.monotonic() < self._next_offer:
            return
        self._next_offer = time.monotonic() + self.interval
        try:
            await self._agent_hello("adopt")
        except AgentUnusable as exc:
            log.debug("no host agent for %s: %s", self.info.node_id, exc)
            return
        except CoordinatorError as exc:
            log.warning("the host agent refused %s: %s", self.info.node_id, exc)
            return
        log.info("%s beats through the host agent at %s", self.info.node_id, self.path)
        if self._direct is not None:
            await self._direct.stop()
            self._direct = None
