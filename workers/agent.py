"""The host agent: `dcs worker` registers and beats for the DCS processes of its host (protocol:
`dcs_tasks/hostagent.py`).

A thread of the worker's main process runs an asyncio loop that serves the agent's Unix socket and, every
heartbeat interval, sends one `POST /heartbeats` for every node whose process renewed its lease in time:
the agent asserts only the liveness of processes it sees alive. A process that exits closes its connection
(its node leaves the beats at once); one that is stopped (SIGSTOP) or whose event loop does not run stops
renewing and leaves the beats once its lease (three renewals, at most 3 s) is over. Registrations that arrive
while one is in flight go out together as one `POST /register_batch`.

A node the coordinator no longer knows is registered again with its rank; one whose rank another node took
over is lost (its process is told at its next renewal). Forked pool processes close the agent's sockets, so a
killed worker's connections end with it and its processes beat for themselves (`NodeLiveness`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from dcs_tasks import hostdirs
from dcs_tasks.aiotask import cancel_and_wait
from dcs_tasks.config import DCSConfig, RoleInfo
from dcs_tasks.coordinator_api import CoordinatorAPI
from dcs_tasks.errors import CoordinatorError, DCSError, NodeNotFound, RankConflict
from dcs_tasks.hostagent import (
    MAX_MESSAGE_BYTES,
    MAX_SOCKET_PATH,
    AgentAnswer,
    AgentHello,
    AgentRequest,
    agent_socket_path,
    encode,
    lock_path,
    sweep_legacy_sockets,
    sweep_stale_sockets,
)
from dcs_tasks.models import BeatOutcome, RegisterResponse

log = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 5.0  # a connection must say who it is within this
MAX_CONNECTIONS = 4096  # processes (nodes) one agent serves at once
# answers a client left unread, beyond what its socket's kernel buffers hold: a process reads each answer before
# it renews again (one line unread at most), so more is a client that does not read, and it is cut off
MAX_UNREAD_BYTES = 16 * 1024
AGENT_RETRY_FOR_S = 10.0


@dataclass
class Lease:
    info: RoleInfo  # with its rank
    identity: str
    lease_s: float
    renewed: float = field(default_factory=time.monotonic)
    lost: str | None = None

    @property
    def key(self) -> tuple[str, int]:
        return (self.info.role_name, self.info.rank or 0)


def _answer_error(status: int, detail: str, source: str = "agent") -> bytes:
    return encode({"ok": False, "status": status, "detail": detail[:4000], "source": source})


def _registered(answer: RegisterResponse) -> bytes:
    return encode(
        AgentAnswer(
            ok=True, rank=answer.rank, node_id=answer.node_id, identity=answer.identity, message=answer.message[:400]
        )
    )


class HostAgent:
    """The agent of one host; `start()` returns False (and serves nothing) when another agent of this user already
    serves the socket, or the socket cannot be made or is not private (`_claim`: logged as an error)."""

    def __init__(self, config: DCSConfig) -> None:
        self.config = config
        self.path: Path = agent_socket_path(config)
        self.interval = config.heartbeat.interval_seconds
        self.token = config.token()
        self.leases: dict[tuple[str, int], Lease] = {}
        self.batches = 0  # POST /heartbeats sent
        self.beats = 0  # node beats recorded
        self.failures = 0
        self._fds: set[int] = set()
        self._lock_fd: int | None = None  # `hostagent.lock_path`, held while serving
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._thread_main, name="dcs-host-agent", daemon=True)
        self._pending: asyncio.Queue[tuple[RoleInfo, asyncio.Future[RegisterResponse]]] | None = None
        self._api: CoordinatorAPI | None = None

    # --- lifecycle (worker thread) -------------------------------------------------------------------
    def start(self, timeout: float = 10.0) -> bool:
        if len(str(self.path).encode()) > MAX_SOCKET_PATH:
            log.warning("host agent not started: its socket path is over %d bytes: %s", MAX_SOCKET_PATH, self.path)
            return False
        try:
            if not self._claim():
                log.info("host agent not started: another worker of this user serves %s", self.path)
                return False
        except (DCSError, OSError) as exc:  # UnsafeHostDirectory: refused, never given way to
            log.error("host agent not started: %s", exc)
            return False
        os.register_at_fork(after_in_child=self._close_in_child)
        self._thread.start()
        if not self._ready.wait(timeout) or not self._thread.is_alive():
            log.warning("host agent did not start within %gs", timeout)
            return False
        log.info("host agent serving %s, beating for its processes at %s", self.path, self.config.base_url)
        return True

    def _claim(self) -> bool:
        """Take the socket's path: False while a live agent of this user serves it (another `dcs worker` of the
        host configured alike holds its lock); True once the path is free to bind. Its directory must be private
        (`dcs_tasks.hostdirs`): one another local user made, a socket of another uid or a link there raise
        UnsafeHostDirectory. A socket of this uid whose lock is free is a killed worker's: removed, as are those
        of other killed workers in the directory and this uid's dead ones in /dev/shm."""
        uids = hostdirs.allowed_uids(self.config)
        if self.path.parent == hostdirs.runtime_path(self.config):
            hostdirs.private_root(self.config, create=True)
        else:
            hostdirs.check_private_dir(self.path.parent, uids)
        hostdirs.check_socket(self.path, uids)  # before the lock file is made beside it
        fd = hostdirs.try_lock(lock_path(self.path))
        if fd is None:
            return False
        self._lock_fd = fd
        if hostdirs.check_socket(self.path, uids):  # stale: its agent's lock was free
            self.path.unlink()
            log.info("host agent: removed the stale socket of a dead worker at %s", self.path)
        removed = sweep_stale_sockets(self.path.parent) + sweep_legacy_sockets()
        if removed:
            log.info("host agent: removed %d sockets of dead workers (%s)", len(removed), removed[0])
        return True

    def _release(self) -> None:
        """Remove the socket, then its lock file while still holding it (`hostdirs.try_lock` copes), then let go."""
        with contextlib.suppress(OSError):
            self.path.unlink()
        if self._lock_fd is not None:
            lock_path(self.path).unlink(missing_ok=True)
            os.close(self._lock_fd)
            self._lock_fd = None

    def _close_in_child(self) -> None:
        """A forked pool process must not hold the agent's sockets, nor its lock: a killed worker's connections
        end with it, and the next worker finds its lock free."""
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)
            self._lock_fd = None
        for fd in list(self._fds):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()

    def stop(self, timeout: float = 5.0) -> None:
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(stop.set)
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _thread_main(self) -> None:
        try:
            asyncio.run(self._main())
        except Exception:
            log.exception("host agent stopped")
        finally:
            self._release()  # however the loop ended, the next worker may serve: the lock is free
            self._ready.set()

    # --- the agent's loop ----------------------------------------------------------------------------
    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._pending = asyncio.Queue()
        cfg = self.config
        self._api = CoordinatorAPI(
            cfg.base_url, self.token, timeout=cfg.coordinator.request_timeout_seconds, retry_for_s=AGENT_RETRY_FOR_S
        )
        server = await asyncio.start_unix_server(self._serve, path=str(self.path), limit=MAX_MESSAGE_BYTES)
        # only this uid (and root) reach the private directory; with a trusted uid, that user's processes connect
        os.chmod(self.path, 0o666 if self.config.host.trusted_uid is not None else 0o600)
        self._fds.update(s.fileno() for s in server.sockets)
        tasks = [asyncio.create_task(self._registrar()), asyncio.create_task(self._beat_loop())]
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            server.close()
            await asyncio.gather(*(cancel_and_wait(task) for task in tasks))
            self._release()
            await self._api.aclose()
            self._fds.clear()  # closed: a later fork must not close whatever reuses their numbers

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        fd = sock.fileno() if sock is not None else -1
        self._fds.add(fd)
        lease: Lease | None = None
        try:
            if len(self._fds) > MAX_CONNECTIONS:
                writer.write(_answer_error(503, f"the host agent serves {MAX_CONNECTIONS} processes at most"))
                return
            lease = await self._hello(reader, writer)
            if lease is None:
                return
            while True:
                raw = await reader.readline()
                if not raw:
                    return  # the process exited or was killed: its node leaves the beats now
                try:
                    AgentRequest.model_validate_json(raw)
                except ValidationError as exc:
                    writer.write(_answer_error(400, f"not a renewal ({{'op': 'renew'}}): {str(exc)[:300]}"))
                    return
                if lease.lost is not None:
                    writer.write(_answer_error(409, lease.lost, "coordinator"))
                    return
                lease.renewed = time.monotonic()
                writer.write(encode({"ok": True, "identity": lease.identity}))
                if writer.transport.get_write_buffer_size() > MAX_UNREAD_BYTES:
                    log.warning("host agent: cut off %s, which does not read its answers", lease.info.node_id)
                    writer.transport.abort()  # its unread answers are dropped, not kept in this process
                    return
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
            log.debug("host agent connection ended: %r", exc)
        finally:
            if lease is not None and self.leases.get(lease.key) is lease:
                del self.leases[lease.key]
            self._fds.discard(fd)
            with contextlib.suppress(Exception):
                async with asyncio.timeout(HELLO_TIMEOUT_S):  # a client that does not read is not waited for
                    await writer.drain()
            writer.close()

    async def _hello(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Lease | None:
        """Read and answer the first line; the node's lease, or None (refused: the answer says why)."""
        try:
            async with asyncio.timeout(HELLO_TIMEOUT_S):
                raw = await reader.readline()
        except TimeoutError:
            writer.write(_answer_error(408, f"no hello within {HELLO_TIMEOUT_S:g}s"))
            return None
        except ValueError:  # asyncio's LimitOverrunError is a ValueError's sibling via readline: line too long
            writer.write(_answer_error(413, f"a message is at most {MAX_MESSAGE_BYTES} bytes"))
            return None
        try:
            hello = AgentHello.model_validate_json(raw)
        except ValidationError as exc:
            writer.write(_answer_error(400, f"not an AgentHello: {str(exc)[:1000]}"))
            return None
        if self.token is not None and not hmac.compare_digest((hello.token or "").encode(), self.token.encode()):
            writer.write(_answer_error(401, "wrong or missing token (DCS_AUTH_TOKEN)"))
            return None
        if hello.coordinator != self.config.base_url:
            writer.write(_answer_error(400, f"this agent beats for {self.config.base_url}, not {hello.coordinator}"))
            return None
        info = hello.node
        if hello.op == "register":
            try:
                answer = await self._register(info)
            except DCSError as exc:
                status = exc.status_code if isinstance(exc, CoordinatorError) and exc.status_code else 503
                writer.write(_answer_error(status, str(exc), "coordinator"))
                return None
            info = info.model_copy(update={"rank": answer.rank})
            identity = answer.identity
            reply = _registered(answer)
        else:
            identity = hello.identity or (f"{info.ip}:{info.port}" if info.port else "")
            if info.rank is None or not identity:
                writer.write(_answer_error(400, "adopt needs the node's rank and its identity (or a port)"))
                return None
            refusal = await self._refuse_adopt(info, identity)
            if refusal is not None:
                writer.write(refusal)
                return None
            reply = encode(AgentAnswer(ok=True, rank=info.rank, node_id=info.node_id, identity=identity))
        lease = Lease(info=info, identity=identity, lease_s=hello.lease_ms / 1000)
        previous = self.leases.get(lease.key)
        if previous is not None:
            previous.lost = f"{info.node_id} was handed to the agent again by another connection"
        self.leases[lease.key] = lease
        assert self._api is not None
        self._api.remember_identity(info.role_name, lease.key[1], identity)
        writer.write(reply)
        await writer.drain()
        return lease

    async def _refuse_adopt(self, info: RoleInfo, identity: str) -> bytes | None:
        """The answer refusing an adopt of `info` claiming `identity`, or None when it may take the lease.

        Fenced as HTTP fences a beat: the coordinator's record decides, with one fenced beat of the claimed
        identity (409 from the coordinator when another node holds the rank; nothing changes here). A node the
        coordinator does not know (it lost its state) is taken, and registered again by the beats. Even with
        the right identity, a lease this agent holds for the rank that is still renewed is not displaced (409
        from the agent): the process holding it is alive, and a restarted one registers, it does not adopt."""
        assert self._api is not None and info.rank is not None
        try:
            async with asyncio.timeout(HELLO_TIMEOUT_S):
                await self._api.heartbeat(info.role_name, info.rank, identity=identity)
        except NodeNotFound:
            pass
        except TimeoutError:
            return _answer_error(503, f"the coordinator did not answer within {HELLO_TIMEOUT_S:g}s", "coordinator")
        except DCSError as exc:
            status = exc.status_code if isinstance(exc, CoordinatorError) and exc.status_code else 503
            log.warning("host agent: refused an adopt of %s as %s: %s", info.node_id, identity, exc)
            return _answer_error(status, str(exc), "coordinator")
        previous = self.leases.get((info.role_name, info.rank))
        if previous is not None and previous.lost is None and time.monotonic() - previous.renewed <= previous.lease_s:
            return _answer_error(409, f"{info.node_id} is held through this agent by a process that renews it")
        return None

    # --- registrations, batched ----------------------------------------------------------------------
    async def _register(self, info: RoleInfo) -> RegisterResponse:
        assert self._pending is not None
        future: asyncio.Future[RegisterResponse] = asyncio.get_running_loop().create_future()
        self._pending.put_nowait((info, future))
        return await future

    async def _registrar(self) -> None:
        """Every registration that waits while one batch is in flight goes out in the next batch."""
        assert self._pending is not None and self._api is not None
        api = self._api
        while True:
            batch = [await self._pending.get()]
            while not self._pending.empty() and len(batch) < 2048:
                batch.append(self._pending.get_nowait())
            try:
                answers = await api.register_many([info for info, _ in batch])
            except RankConflict as exc:
                if len(batch) == 1:
                    _settle(batch[0][1], exc)
                    continue
                for info, future in batch:  # one of them is refused: find which, one at a time
                    try:
                        _settle(future, await api.register(info))
                    except DCSError as one:
                        _settle(future, one)
                continue
            except DCSError as exc:
                for _, future in batch:
                    _settle(future, exc)
                continue
            for (_, future), answer in zip(batch, answers, strict=True):
                _settle(future, answer)

    # --- beats ---------------------------------------------------------------------------------------
    async def _beat_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                await self.beat_once()
            except DCSError as exc:
                self.failures += 1
                log.warning("host agent: beating %d nodes failed (will retry): %s", len(self.leases), exc)
            await asyncio.sleep(max(0.0, self.interval - (loop.time() - started)))

    async def beat_once(self) -> None:
        """One POST /heartbeats for every node whose lease is fresh."""
        assert self._api is not None
        now = time.monotonic()
        fresh = [lease for lease in self.leases.values() if lease.lost is None and now - lease.renewed <= lease.lease_s]
        if not fresh:
            return
        outcomes = await self._api.heartbeat_many([lease.key for lease in fresh])
        self.batches += 1
        missing: list[Lease] = []
        for lease, outcome in zip(fresh, outcomes, strict=True):
            if outcome is BeatOutcome.OK:
                self.beats += 1
            elif outcome is BeatOutcome.NOT_FOUND:
                missing.append(lease)
            else:
                lease.lost = f"{lease.info.node_id} is now held by another node; {lease.identity} was presumed dead"
                log.error("host agent: %s", lease.lost)
        for lease in missing:  # unknown to the coordinator (unregistered, flushed): registered again, its rank kept
            if self.leases.get(lease.key) is not lease:
                continue  # its process left meanwhile (it unregisters after closing its connection)
            try:
                answer = await self._api.register(lease.info)
            except RankConflict as exc:
                lease.lost = str(exc)
                continue
            lease.identity = answer.identity or lease.identity
            self.beats += 1


def _settle(future: asyncio.Future[RegisterResponse], outcome: RegisterResponse | BaseException) -> None:
    if future.done():  # its connection went away meanwhile
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


_agent: HostAgent | None = None


def start_host_agent(config: DCSConfig) -> HostAgent | None:
    """Start this worker's host agent when `config.host.agent` (idempotent)."""
    global _agent
    if not config.host.agent or _agent is not None:
        return _agent
    agent = HostAgent(config)
    if agent.start():
        _agent = agent
    return _agent


def stop_host_agent() -> None:
    global _agent
    agent, _agent = _agent, None
    if agent is not None:
        agent.stop()
