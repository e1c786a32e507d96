"""The memory tier's peer transport: one committed step directory copied between two hosts' memory tiers.

A `PeerServer` (one per `dcs worker`) serves its memory root (`<root>/<run>/step-N/` or
`<root>/<run>/rank-N/step-N/`, the checkpoint root's layout) over TCP, one thread per connection (at most
`max_connections`). Clients: `push_step` (op `put`: send a step, the server installs it), `pull_step` (op
`get`: fetch a step and install it locally) and `list_steps` (op `list`: the committed steps of a run).

A connection (`peerchannel`: both sides authenticated with the shared token, every header MACed under a
session key), then:
1. The request: `{"op": "put", "rel"}` + the manifest, answered `have` (the step is committed there already:
   nothing is sent, nothing replaced) or `send`; or `{"op": "get", "rel", "max_bytes"}`, answered `send` +
   the manifest; or `{"op": "list", "run"}`, answered with the list.
2. For put/get: every file's bytes, raw, in manifest order (the sender `sendfile`s them from the file
   descriptors), then a trailer `{"done": total bytes}`; a put is answered `ok` (installed) or `have` (another
   copy was installed first).
How a step is named, checked, received (hashed on arrival, installed atomically, never replacing a committed
step) and sent: `peersteps`. A manifest is at most `peersteps.MAX_MANIFEST_BYTES`, a list `MAX_LIST_BYTES`.

Errors (dcs_tasks.errors): PeerAuthFailed (a PeerRefused), PeerRefused (bad name, over a limit, compressed or
incremental files, no room), PeerCorrupt (bytes, checksums, manifest or frames that do not verify; bytes beyond
those announced), PeerNotFound, PeerUnavailable (unreachable, closed mid-transfer, no answer within `timeout`,
no free connection slot). Every socket call has the timeout; the handshake and the request must arrive within
`timeout` in all. A local step that fails its checks before a push: CorruptCheckpoint; a local file system
failure on the pulling side: its OSError.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dcs_tasks.checkpoint.format.layout import MANIFEST_NAME
from dcs_tasks.checkpoint.store.payloads import run_name_problem
from dcs_tasks.checkpoint.store.peerchannel import (
    Address,
    Channel,
    accept_session,
    client_session,
    named_cause,
    short,
    token_bytes,
    tune,
)
from dcs_tasks.checkpoint.store.peersteps import (
    MAX_MANIFEST_BYTES,
    LocalWriteError,
    check_step_manifest,
    committed_steps,
    is_committed,
    open_dir,
    open_files,
    open_parent,
    parse_rel,
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
MAX_CONNECTIONS = 16
STOP_JOIN_SECONDS = 10.0
_ACCEPT_POLL = 0.2


# --- the server ---------------------------------------------------------------------------------------------


class PeerServer:
    """Serves the memory root `root` to peers that know `token` (module doc). `max_step_bytes` bounds the step
    a put may bring (and so each connection's temp directory); `timeout`: every socket call's, and the whole
    handshake's plus request's. `on_installed(rel)` is called (in the connection's thread, after the peer was
    answered) for every step a put installed. `errors` keeps the last failures (newest last), for logs and
    tests."""

    def __init__(
        self,
        root: Path,
        token: str,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        max_step_bytes: int,
        timeout: float = 30.0,
        max_connections: int = MAX_CONNECTIONS,
        on_installed: Callable[[str], None] | None = None,
    ) -> None:
        self._token = token_bytes(token)
        if max_step_bytes <= 0 or timeout <= 0 or max_connections <= 0:
            raise ConfigError("max_step_bytes, timeout and max_connections must be positive")
        self.root = Path(root)
        self.host = host
        self.port = port
        self.max_step_bytes = max_step_bytes
        self.timeout = timeout
        self.max_connections = max_connections
        self.on_installed = on_installed
        self.errors: deque[PeerError] = deque(maxlen=64)
        self._listener: socket.socket | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._conns: dict[threading.Thread, socket.socket] = {}
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
            peer = f"{addr[0]}:{addr[1]}"
            with self._lock:
                busy = len(self._conns) >= self.max_connections
                if not busy:
                    thread = threading.Thread(
                        target=self._serve, args=(sock, peer), name=f"dcs-peer {peer}", daemon=True
                    )
                    self._conns[thread] = sock
            if busy:
                self._refuse_busy(sock, peer)
                continue
            thread.start()

    def _refuse_busy(self, sock: socket.socket, peer: str) -> None:
        with contextlib.suppress(OSError):
            ch = Channel(sock, peer, min(self.timeout, 1.0), server=True)
            ch.send_error(PeerUnavailable(f"all {self.max_connections} connection slots are busy"))
        sock.close()

    def _serve(self, sock: socket.socket, peer: str) -> None:
        try:
            tune(sock)
            ch = Channel(sock, peer, self.timeout, server=True)
            try:
                ch.deadline = time.monotonic() + self.timeout
                accept_session(ch, self._token)
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
                sock.close()
            except PeerError as exc:
                self._failed(ch, exc)
            except CorruptCheckpoint as exc:
                self._failed(ch, PeerCorrupt(str(exc)))
            except LocalWriteError as exc:
                self._failed(ch, PeerRefused(f"cannot store the step: {exc.cause.strerror or exc.cause}"))
            except OSError as exc:
                self._failed(ch, PeerRefused(f"cannot serve the request: {exc.strerror or exc}"))
            except Exception as exc:  # a bug must not kill the server silently
                log.exception("peer server: request from %s failed", peer)
                self._failed(ch, PeerError(f"internal error: {type(exc).__name__}"))
        finally:
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

    def _put(self, ch: Channel, request: dict[str, Any]) -> None:
        rel = parse_rel(request.get("rel"))
        raw = ch.recv_blob(MAX_MANIFEST_BYTES, f"receiving the manifest of {rel}")
        manifest = check_step_manifest(raw, rel, self.max_step_bytes)
        parent_fd = open_parent(self.root, rel, create=True)
        assert parent_fd is not None
        try:
            if is_committed(parent_fd, rel.parts[-1], rel):
                ch.send({"status": "have"})
                return
            ch.send({"status": "send"})
            ch.deadline = None
            installed = receive_step(ch, self.root.joinpath(*rel.parts[:-1]), parent_fd, rel, manifest, raw)
        finally:
            os.close(parent_fd)
        ch.send({"status": "ok" if installed else "have", "bytes": manifest.total_bytes})
        log.info("peer server: %s %s from %s", "installed" if installed else "already had", rel, ch.peer)
        if installed and self.on_installed is not None:
            try:
                self.on_installed(str(rel))
            except Exception:  # the step is installed and the peer told so: a failing hook is only logged
                log.exception("peer server: on_installed(%r) failed", str(rel))

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
            raw = read_manifest_at(step_fd, rel)
            if raw is None:
                raise PeerNotFound(f"step {rel} is not committed here")
            manifest = check_step_manifest(raw, rel, min(limit, self.max_step_bytes))
            fds = open_files(step_fd, manifest, rel)
        finally:
            os.close(step_fd)
        try:
            ch.send({"status": "send"})
            ch.send_blob(raw, f"sending the manifest of {rel}")
            ch.deadline = None
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


def push_step(address: Address, token: str, step_dir: Path, rel: str, *, timeout: float) -> int:
    """Send the committed step at `step_dir` to the peer at `address`, which installs it as `rel`; the bytes of
    file data sent (0 when the peer said it holds the step already, before any byte went: it is never replaced;
    a copy that another one beat to the rename counts its bytes and leaves the first in place). The local step is
    checked first (CorruptCheckpoint: its manifest fails the checks, names another step than `rel`, or a file is
    not a regular file of its recorded size; PeerRefused: it is compressed or incremental)."""
    step = parse_rel(rel)
    step_fd = open_dir(str(step_dir), None, str(step_dir))
    try:
        raw = read_manifest_at(step_fd, step)
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
            ch.deadline = None
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


def pull_step(address: Address, token: str, rel: str, dest_root: Path, *, timeout: float, max_bytes: int) -> Path:
    """Fetch the step `rel` from the peer at `address` and install it, verified, as `dest_root/rel` (module doc:
    temp directory, checksums, manifest last, atomic rename); its path. A step already committed there is kept
    and returned without asking the peer. PeerRefused when the step has more than `max_bytes` bytes."""
    step = parse_rel(rel)
    dest_root = Path(dest_root)
    dest_root.mkdir(parents=True, exist_ok=True)
    final = dest_root.joinpath(*step.parts)
    parent_fd = open_parent(dest_root, step, create=True)
    assert parent_fd is not None
    try:
        if is_committed(parent_fd, step.parts[-1], step):
            return final
        ch = client_session(address, token, timeout)
        try:
            ch.send({"op": "get", "rel": str(step), "max_bytes": max_bytes})
            ch.reply(f"asking for {step}", "send")
            raw = ch.recv_blob(MAX_MANIFEST_BYTES, f"receiving the manifest of {step}")
            try:
                manifest = check_step_manifest(raw, step, max_bytes)
            except CorruptCheckpoint as exc:
                raise PeerCorrupt(f"peer {ch.peer}: {exc}") from exc
            ch.deadline = None
            try:
                receive_step(ch, final.parent, parent_fd, step, manifest, raw)
            except LocalWriteError as exc:
                raise exc.cause from exc
        finally:
            ch.sock.close()
    finally:
        os.close(parent_fd)
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
