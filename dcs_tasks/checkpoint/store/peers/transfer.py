"""The memory tier's peer transport: one committed step directory copied between two hosts' memory tiers.

A `PeerServer` (one per `dcs worker`) serves its memory root (`<root>/<run>/step-N/` or
`<root>/<run>/rank-N/step-N/`, the checkpoint root's layout) over TCP, one thread per connection. A connection that
has not authenticated holds one of `MAX_PENDING` handshake places (at most `per_source` from one source address;
more are closed at once) for at most `handshake_seconds`; only once it has authenticated does it take one of the
`max_connections` slots that transfers run in, so connections that never authenticate cannot keep authenticated ones
waiting. A transfer's bytes must keep `min_rate` (`channel.Pace`). Clients: `push_step` (op `put`: send a step,
the server installs it), `pull_step` (op `get`: fetch a step and install it locally) and `list_steps` (op `list`:
the committed steps of a run).

A connection (`channel`: both sides authenticated with the shared token, every header MACed under a
session key), then:
1. The request: `{"op": "put", "rel"}` + the manifest, answered `have` (the step is committed there already:
   nothing is sent, nothing replaced) or `send`. Before `send` the server has the step checked by `accept_put`
   (whose step it is: the memory tier accepts only a step another host committed, with that manifest) and
   reserved its bytes (manifest, files, seal) against `room` (what the memory tier may still take, less what
   transfers in flight reserved): a put that does not fit is refused before any byte of it lands. Or
   `{"op": "get", "rel", "max_bytes"}`, answered `send` + the manifest; or `{"op": "list", "run"}`, answered
   with the list.
2. For put/get: every file's bytes, raw, in manifest order (the sender `sendfile`s them from the file
   descriptors), then a trailer `{"done": total bytes}`; a put is answered `ok` (installed) or `have` (another
   copy was installed first).
How a step is named, checked, received (hashed on arrival, installed atomically, never replacing a committed
step) and sent: `stepfiles`. A manifest is at most `max_manifest_bytes` (default `stepfiles.MAX_MANIFEST_BYTES`),
a list `MAX_LIST_BYTES`. A refused or failed put leaves no directory behind (`stepfiles.prune_parents`).

Errors (dcs_tasks.errors): PeerAuthFailed (a PeerRefused), PeerRefused (bad name, over a limit, compressed or
incremental files, no room), PeerCorrupt (bytes, checksums, manifest or frames that do not verify; bytes beyond
those announced), PeerNotFound, PeerUnavailable (unreachable, closed mid-transfer, no answer within `timeout`, no
free connection slot, too slow). Every socket call has the timeout; the handshake must complete within
`handshake_seconds`, the request (a put's manifest included) within `handshake_seconds` plus the largest
manifest's time at `min_rate` (9 s by default), at most `timeout`. A local step that fails its checks before a push:
CorruptCheckpoint; a local file system failure on the pulling side: its OSError.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dcs_tasks.checkpoint.format.layout import MANIFEST_NAME, Manifest
from dcs_tasks.checkpoint.store.payloads import run_name_problem
from dcs_tasks.checkpoint.store.peers.channel import (
    RATE_WINDOW_SECONDS,
    Address,
    Channel,
    Pace,
    accept_session,
    client_session,
    named_cause,
    short,
    token_bytes,
    tune,
)
from dcs_tasks.checkpoint.store.peers.stepfiles import (
    MAX_MANIFEST_BYTES,
    LocalWriteError,
    StepRel,
    check_step_manifest,
    committed_steps,
    is_committed,
    open_dir,
    open_files,
    open_parent,
    parse_rel,
    prune_parents,
    read_manifest_at,
    receive_step,
    remove_stale_incoming,
    send_files,
)
from dcs_tasks.errors import (
    ConfigError,
    CorruptCheckpoint,
    PeerCorrupt,
    PeerError,
    PeerNotFound,
    PeerRefused,
    PeerUnavailable,
)

log = logging.getLogger(__name__)

MAX_LIST_BYTES = 4 * 1024 * 1024
MAX_CONNECTIONS = 16  # authenticated connections at once (transfers)
MAX_PENDING = 64  # connections not yet authenticated, at once
PER_SOURCE = 8  # of those, from one source address
HANDSHAKE_SECONDS = 5.0
MIN_RATE = 1 << 20  # bytes/s a transfer must keep (channel.Pace)
SEAL_BYTES_PER_FILE = 128  # what a received step's seal.json takes per file, with room to spare
STOP_JOIN_SECONDS = 10.0
_ACCEPT_POLL = 0.2


# --- the server ---------------------------------------------------------------------------------------------


def _as_peer_error(exc: Exception, peer: str) -> PeerError:
    """What a peer is told when serving its request raised `exc`."""
    if isinstance(exc, PeerError):
        return exc
    if isinstance(exc, CorruptCheckpoint):
        return PeerCorrupt(str(exc))
    if isinstance(exc, LocalWriteError):
        return PeerRefused(f"cannot store the step: {exc.cause.strerror or exc.cause}")
    if isinstance(exc, OSError):
        return PeerRefused(f"cannot serve the request: {exc.strerror or exc}")
    log.exception("peer server: request from %s failed", peer)  # a bug must not kill the server silently
    return PeerError(f"internal error: {type(exc).__name__}")


class PeerServer:
    """Serves the memory root `root` to peers that know `token` (module doc). `accept_put(rel, manifest bytes)`
    raises PeerRefused for a step a put may not bring (the memory tier's: `tiers.PutCheck`); `room()`, when
    given, is the bytes the memory tier may still take. `max_step_bytes` bounds the step a put may bring (and so
    each connection's temp directory); `timeout`: every socket call's, and the request's; `handshake_seconds`:
    the handshake's; `min_rate`: the bytes/s a transfer must keep (0: none), judged over each `rate_window`
    seconds. `on_installed(rel)` is called (in the connection's thread, after the peer was answered) for every
    step a put installed. `errors` keeps the last failures (newest last), for logs and tests."""

    def __init__(
        self,
        root: Path,
        token: str,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        max_step_bytes: int,
        accept_put: Callable[[StepRel, bytes], None],
        room: Callable[[], int] | None = None,
        timeout: float = 30.0,
        handshake_seconds: float = HANDSHAKE_SECONDS,
        max_connections: int = MAX_CONNECTIONS,
        per_source: int = PER_SOURCE,
        min_rate: float = MIN_RATE,
        rate_window: float = RATE_WINDOW_SECONDS,
        max_manifest_bytes: int = MAX_MANIFEST_BYTES,
        on_installed: Callable[[str], None] | None = None,
    ) -> None:
        self._token = token_bytes(token)
        numbers = (max_step_bytes, timeout, handshake_seconds, max_connections, per_source, max_manifest_bytes)
        if min(numbers) <= 0 or min_rate < 0 or rate_window <= 0:
            raise ConfigError(
                "max_step_bytes, timeout, handshake_seconds, max_connections, per_source, max_manifest_bytes and "
                "rate_window must be positive, min_rate >= 0"
            )
        self.root = Path(root)
        self.host = host
        self.port = port
        self.max_step_bytes = max_step_bytes
        self.accept_put = accept_put
        self.room = room
        self.timeout = timeout
        self.handshake_seconds = handshake_seconds
        self.max_connections = max_connections
        self.per_source = per_source
        self.min_rate = min_rate
        self.rate_window = rate_window
        self.max_manifest_bytes = max_manifest_bytes
        self.on_installed = on_installed
        self.errors: deque[PeerError] = deque(maxlen=64)
        self._listener: socket.socket | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._conns: dict[threading.Thread, socket.socket] = {}
        self._pending: dict[str, int] = {}  # source address -> connections not yet authenticated
        self._slots = threading.BoundedSemaphore(max_connections)
        self._reserved = 0  # bytes reserved by the puts in flight
        self._acceptor: threading.Thread | None = None
        self._bound: Address | None = None

    @property
    def address(self) -> Address:
        if self._bound is None:
            raise PeerError("the peer server is not started")
        return self._bound

    def start(self) -> Address:
        """Bind, listen and accept in a thread; the bound (host, port). Removes temp directories that an earlier
        server on this root left behind."""
        self.root.mkdir(parents=True, exist_ok=True)
        stale = remove_stale_incoming(self.root)
        if stale:
            log.info("removed %d stale incoming step directories under %s", stale, self.root)
        infos = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, where = infos[0]
        listener = socket.socket(family, kind, proto)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            tune(listener)
            listener.bind(where)
            listener.listen(64)
            listener.settimeout(_ACCEPT_POLL)
        except BaseException:
            listener.close()
            raise
        self._listener = listener
        host, port = listener.getsockname()[:2]
        self._bound = (str(host), int(port))
        self._acceptor = threading.Thread(target=self._accept_loop, name="dcs-peer-accept", daemon=True)
        self._acceptor.start()
        return self.address

    def stop(self, wait: float = STOP_JOIN_SECONDS) -> None:
        """Stop accepting, cut every open connection (their temp directories are removed) and join the threads,
        at most `wait` seconds in all."""
        self._stopping.set()
        deadline = time.monotonic() + wait
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept at once
        if self._acceptor is not None:
            self._acceptor.join(max(0.0, deadline - time.monotonic()))
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            conns = list(self._conns.items())
        for _, sock in conns:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for thread, _ in conns:
            thread.join(max(0.0, deadline - time.monotonic()))
        left = [t.name for t, _ in conns if t.is_alive()]
        if left:
            log.warning("peer server on %s: %d connection threads still running after %ss", self.root, len(left), wait)

    def __enter__(self) -> PeerServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            try:
                sock, addr = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stopping.is_set():
                    return
                time.sleep(_ACCEPT_POLL)  # EMFILE and friends: back off, keep serving
                continue
            source, peer = str(addr[0]), f"{addr[0]}:{addr[1]}"
            with self._lock:
                waiting = self._pending.get(source, 0)
                busy = sum(self._pending.values()) >= MAX_PENDING or waiting >= self.per_source
                if not busy:
                    self._pending[source] = waiting + 1
                    thread = threading.Thread(
                        target=self._serve, args=(sock, source, peer), name=f"dcs-peer {peer}", daemon=True
                    )
                    self._conns[thread] = sock
            if busy:
                self._refuse(sock, "too many connections are authenticating (from this address or in all)")
                continue
            thread.start()

    @staticmethod
    def _refuse(sock: socket.socket, why: str) -> None:
        """Tell a connection why it is closed, without waiting on it (a frame fits any socket buffer)."""
        with contextlib.suppress(OSError):
            sock.setblocking(False)
            body = json.dumps({"error": "unavailable", "message": why}).encode()
            sock.send(struct.pack(">I", len(body)) + body)
        sock.close()

    def _authenticate(self, ch: Channel, source: str) -> bool:
        """The handshake within `handshake_seconds`, holding one of the source's handshake places; then one of the
        transfer slots (False, the connection told, when none is free)."""
        try:
            ch.deadline, ch.allowed = time.monotonic() + self.handshake_seconds, self.handshake_seconds
            accept_session(ch, self._token)
        finally:
            with self._lock:
                left = self._pending.get(source, 1) - 1
                if left:
                    self._pending[source] = left
                else:
                    self._pending.pop(source, None)
        if not self._slots.acquire(blocking=False):
            ch.send_error(PeerUnavailable(f"all {self.max_connections} transfer slots are busy"))
            return False
        return True

    def _request_seconds(self) -> float:
        """What the request (and a put's manifest) may take once authenticated: the handshake's time plus the
        largest manifest at the minimum rate, at most `timeout`; so an authenticated peer that says nothing
        holds a transfer slot no longer than that."""
        if not self.min_rate:
            return self.timeout
        return min(self.timeout, self.handshake_seconds + self.max_manifest_bytes / self.min_rate)

    def _serve(self, sock: socket.socket, source: str, peer: str) -> None:
        slot = False
        try:
            tune(sock)
            ch = Channel(sock, peer, self.timeout, server=True)
            failure: PeerError | None = None
            try:
                slot = self._authenticate(ch, source)
                if not slot:
                    return
                allowed = self._request_seconds()
                ch.deadline, ch.allowed = time.monotonic() + allowed, allowed
                request = ch.recv("receiving the request")
                op = request.get("op")
                if op == "put":
                    self._put(ch, request)
                elif op == "get":
                    self._get(ch, request)
                elif op == "list":
                    self._list(ch, request)
                else:
                    raise PeerRefused(f"unknown operation {short(op)}")
            except Exception as exc:
                failure = _as_peer_error(exc, peer)
            # the slot is free before the peer sees the connection end, so its next request finds it free
            if slot:
                slot = False
                self._slots.release()
            if failure is not None:
                self._failed(ch, failure)
        finally:
            if slot:
                self._slots.release()
            sock.close()
            with self._lock:
                self._conns.pop(threading.current_thread(), None)

    def _failed(self, ch: Channel, exc: PeerError) -> None:
        self.errors.append(exc)
        log.warning("peer server: request from %s failed: %s", ch.peer, exc)
        if isinstance(exc, PeerUnavailable):
            ch.sock.close()
            return
        ch.send_error(exc)
        ch.linger_close()

    def _reserve(self, nbytes: int, rel: object) -> None:
        """Reserve `nbytes` of the memory tier for a put in flight; PeerRefused when they do not fit."""
        with self._lock:
            free = (self.room() if self.room is not None else self.max_step_bytes) - self._reserved
            if nbytes > free:
                raise PeerRefused(f"no room for {rel}: it needs {nbytes} bytes, the memory tier has {max(free, 0)}")
            self._reserved += nbytes

    def _release(self, nbytes: int) -> None:
        with self._lock:
            self._reserved -= nbytes

    def _put(self, ch: Channel, request: dict[str, Any]) -> None:
        rel = parse_rel(request.get("rel"))
        held = 0
        try:

            def admit(size: int) -> None:  # the manifest's bytes count before they are read
                nonlocal held
                self._reserve(size, rel)
                held = size

            what = f"receiving the manifest of {rel}"
            raw = ch.recv_blob(self.max_manifest_bytes, what, admit)
            manifest = check_step_manifest(raw, rel, self.max_step_bytes)
            self.accept_put(rel, raw)
            step_bytes = manifest.total_bytes + SEAL_BYTES_PER_FILE * (len(manifest.files) + 1)
            self._reserve(step_bytes, rel)
            held += step_bytes
            installed = self._receive(ch, rel, manifest, raw)
        finally:
            self._release(held)
        if installed is None:
            return
        ch.send({"status": "ok" if installed else "have", "bytes": manifest.total_bytes})
        log.info("peer server: %s %s from %s", "installed" if installed else "already had", rel, ch.peer)
        if installed and self.on_installed is not None:
            try:
                self.on_installed(str(rel))
            except Exception:  # the step is installed and the peer told so: a failing hook is only logged
                log.exception("peer server: on_installed(%r) failed", str(rel))

    def _receive(self, ch: Channel, rel: StepRel, manifest: Manifest, raw: bytes) -> bool | None:
        """Receive and install the step (True), or find it installed (False: another put was first; None: it
        was there already, the peer told `have`). The directories made for it go again when it fails."""
        parent_fd = open_parent(self.root, rel, create=True)
        assert parent_fd is not None
        installed: bool | None = None
        try:
            if is_committed(parent_fd, rel.parts[-1], rel):
                ch.send({"status": "have"})
                return None
            ch.send({"status": "send"})
            ch.start_transfer(Pace(self.min_rate, self.rate_window))
            installed = receive_step(ch, self.root.joinpath(*rel.parts[:-1]), parent_fd, rel, manifest, raw)
            return installed
        finally:
            os.close(parent_fd)
            if not installed:
                prune_parents(self.root, rel)

    def _get(self, ch: Channel, request: dict[str, Any]) -> None:
        rel = parse_rel(request.get("rel"))
        limit = request.get("max_bytes")
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise PeerRefused(f"max_bytes {short(limit)} is not an integer >= 0")
        parent_fd = open_parent(self.root, rel, create=False)
        if parent_fd is None:
            raise PeerNotFound(f"no step {rel} here")
        try:
            try:
                step_fd = open_dir(rel.parts[-1], parent_fd, str(rel))
            except FileNotFoundError as exc:
                raise PeerNotFound(f"no step {rel} here") from exc
        finally:
            os.close(parent_fd)
        try:
            raw = read_manifest_at(step_fd, rel, self.max_manifest_bytes)
            if raw is None:
                raise PeerNotFound(f"step {rel} is not committed here")
            manifest = check_step_manifest(raw, rel, min(limit, self.max_step_bytes))
            fds = open_files(step_fd, manifest, rel)
        finally:
            os.close(step_fd)
        try:
            ch.send({"status": "send"})
            ch.send_blob(raw, f"sending the manifest of {rel}")
            ch.start_transfer(Pace(self.min_rate, self.rate_window))
            send_files(ch, fds, manifest, rel)
        finally:
            for fd in fds:
                os.close(fd)

    def _list(self, ch: Channel, request: dict[str, Any]) -> None:
        run = request.get("run")
        problem = run_name_problem(run)
        if problem is not None:
            raise PeerRefused(problem)
        assert isinstance(run, str)
        ch.send({"status": "list"})
        ch.send_blob(json.dumps(committed_steps(self.root, run)).encode(), "sending the list")


# --- clients ------------------------------------------------------------------------------------------------


def push_step(
    address: Address,
    token: str,
    step_dir: Path,
    rel: str,
    *,
    timeout: float,
    min_rate: float = MIN_RATE,
    rate_window: float = RATE_WINDOW_SECONDS,
    max_manifest_bytes: int = MAX_MANIFEST_BYTES,
) -> int:
    """Send the committed step at `step_dir` to the peer at `address`, which installs it as `rel`; the bytes of
    file data sent (0 when the peer said it holds the step already, before any byte went: it is never replaced;
    a copy that another one beat to the rename counts its bytes and leaves the first in place). The local step is
    checked first (CorruptCheckpoint: its manifest fails the checks, is over `max_manifest_bytes`, names another
    step than `rel`, or a file is not a regular file of its recorded size; PeerRefused: it is compressed or
    incremental)."""
    step = parse_rel(rel)
    step_fd = open_dir(str(step_dir), None, str(step_dir))
    try:
        raw = read_manifest_at(step_fd, step, max_manifest_bytes)
        if raw is None:
            raise CorruptCheckpoint(f"{step_dir} has no {MANIFEST_NAME}: it is not a committed step", str(step_dir))
        manifest = check_step_manifest(raw, step, 1 << 62)
        fds = open_files(step_fd, manifest, step)
    finally:
        os.close(step_fd)
    try:
        ch = client_session(address, token, timeout)
        try:
            ch.send({"op": "put", "rel": str(step)})
            ch.send_blob(raw, f"sending the manifest of {step}")
            if ch.reply(f"offering {step}", "have", "send")["status"] == "have":
                return 0
            ch.start_transfer(Pace(min_rate, rate_window))
            try:
                sent = send_files(ch, fds, manifest, step)
            except PeerUnavailable as exc:
                named_cause(ch, exc)
                raise
            ch.reply(f"waiting for the peer to install {step}", "ok", "have")
            return sent
        finally:
            ch.sock.close()
    finally:
        for fd in fds:
            os.close(fd)


def pull_step(
    address: Address,
    token: str,
    rel: str,
    dest_root: Path,
    *,
    timeout: float,
    max_bytes: int,
    accept: Callable[[StepRel, bytes], None] | None = None,
    min_rate: float = MIN_RATE,
    rate_window: float = RATE_WINDOW_SECONDS,
    max_manifest_bytes: int = MAX_MANIFEST_BYTES,
) -> Path:
    """Fetch the step `rel` from the peer at `address` and install it, verified, as `dest_root/rel` (module doc:
    temp directory, checksums, manifest last, atomic rename); its path. A step already committed there is kept
    and returned without asking the peer. PeerRefused when the step has more than `max_bytes` bytes;
    `accept(rel, manifest bytes)` may refuse the manifest the peer sent (PeerRefused, PeerCorrupt) before any
    file byte is taken."""
    step = parse_rel(rel)
    dest_root = Path(dest_root)
    dest_root.mkdir(parents=True, exist_ok=True)
    final = dest_root.joinpath(*step.parts)
    parent_fd = open_parent(dest_root, step, create=True)
    assert parent_fd is not None
    installed = False
    try:
        if is_committed(parent_fd, step.parts[-1], step):
            installed = True
            return final
        ch = client_session(address, token, timeout)
        try:
            ch.send({"op": "get", "rel": str(step), "max_bytes": max_bytes})
            ch.reply(f"asking for {step}", "send")
            raw = ch.recv_blob(max_manifest_bytes, f"receiving the manifest of {step}")
            try:
                manifest = check_step_manifest(raw, step, max_bytes)
            except CorruptCheckpoint as exc:
                raise PeerCorrupt(f"peer {ch.peer}: {exc}") from exc
            if accept is not None:
                accept(step, raw)
            ch.start_transfer(Pace(min_rate, rate_window))
            try:
                receive_step(ch, final.parent, parent_fd, step, manifest, raw)
            except LocalWriteError as exc:
                raise exc.cause from exc
            installed = True
        finally:
            ch.sock.close()
    finally:
        os.close(parent_fd)
        if not installed:
            prune_parents(dest_root, step)
    return final


def list_steps(address: Address, token: str, run: str, *, timeout: float) -> list[str]:
    """The rels of the committed steps of `run` the peer holds, sorted by rank then step."""
    problem = run_name_problem(run)
    if problem is not None:
        raise PeerRefused(problem)
    ch = client_session(address, token, timeout)
    try:
        ch.send({"op": "list", "run": run})
        ch.reply(f"listing {run}", "list")
        body = ch.recv_blob(MAX_LIST_BYTES, f"receiving the list of {run}")
    finally:
        ch.sock.close()
    try:
        rels = json.loads(body)
    except (ValueError, RecursionError):
        rels = None
    if not isinstance(rels, list):
        raise PeerCorrupt(f"peer {ch.peer}: the list of {run} is not a JSON list")
    out = []
    for rel in rels:
        try:
            step = parse_rel(rel)
        except PeerRefused as exc:
            raise PeerCorrupt(f"peer {ch.peer}: listed {exc}") from exc
        if step.run != run:
            raise PeerCorrupt(f"peer {ch.peer}: listed {rel!r}, not a step of {run!r}")
        out.append(str(step))
    return out
