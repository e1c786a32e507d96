"""The memory tier's peer transport, its connection: an authenticated channel of framed JSON headers over one
TCP socket (`transfer` builds its operations on it; `stepfiles` moves a step's file bytes through its socket).

Every header is a JSON object in a frame: 4-byte big-endian length, then once the session key exists a 32-byte
HMAC-SHA256 tag, then the JSON; at most `MAX_HEADER_BYTES` (a caller may allow a larger blob, a manifest);
never pickle. The handshake (`client_session` on one side, `accept_session` on the other):
1. server -> client: `{"proto", "nonce"}` (32 fresh random bytes).
2. client -> server: its own fresh nonce and HMAC(token, "client" + both nonces). A wrong one: the server
   answers `{"error": "auth"}` and closes (PeerAuthFailed), having written nothing.
3. server -> client: HMAC(token, "server" + both nonces): the server proves it knows the token too, before the
   client sends anything about a step (a wrong one: PeerAuthFailed, the client sends nothing more).
4. Both derive the session key HMAC(token, "session" + both nonces); every later frame carries the HMAC of
   (direction, sequence number, body) under it, so headers and manifests cannot be altered or replayed on the
   way. File bytes are not MACed: the receiver checks them against the manifest's checksums, which are.

An error travels as `{"error": kind, "message"}` and is raised on the other side as its named error
(dcs_tasks.errors: PeerAuthFailed, PeerRefused, PeerCorrupt, PeerNotFound, PeerUnavailable). Every socket call
has the timeout (SO_RCVTIMEO/SO_SNDTIMEO); while `deadline` is set (the handshake, then the request) every call
waits only what is left of it. While a step's bytes move, `pace` (when set) holds the peer to a minimum rate: fewer
than `Pace.min_rate` bytes a second over any `Pace.window` is PeerUnavailable, so a peer that trickles cannot hold
a connection (and the receiver's temp directory) for long. A socket failure is PeerUnavailable naming the peer and
what was going on.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import secrets
import socket
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from dcs_tasks.errors import (
    ConfigError,
    PeerAuthFailed,
    PeerCorrupt,
    PeerError,
    PeerNotFound,
    PeerRefused,
    PeerUnavailable,
)

PROTOCOL = "dcs-peer/1"
MAX_HEADER_BYTES = 64 * 1024
MAX_MESSAGE = 500  # characters of a peer's error message kept
NONCE_BYTES = 32
TAG_BYTES = 32
RATE_WINDOW_SECONDS = 10.0  # a transfer's minimum rate is judged over windows this long (peer_rate_window_seconds)
SOCKET_BUFFER_BYTES = 16 << 20  # asked for when net.core.[rw]mem_max allow that much, else TCP autotuning
_ERROR_KINDS: dict[str, type[PeerError]] = {
    "auth": PeerAuthFailed,
    "refused": PeerRefused,
    "corrupt": PeerCorrupt,
    "not_found": PeerNotFound,
    "unavailable": PeerUnavailable,
}

Address = tuple[str, int]


def short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def buffer_limit() -> int:
    try:
        return min(int(Path(f"/proc/sys/net/core/{name}_max").read_text()) for name in ("rmem", "wmem"))
    except (OSError, ValueError):
        return 0


def tune(sock: socket.socket) -> None:
    """TCP_NODELAY; send and receive buffers of `SOCKET_BUFFER_BYTES` when the kernel allows that much. Else
    they are left to TCP's autotuning, which grows them up to net.ipv4.tcp_rmem/tcp_wmem's maximum (32 MiB and
    4 MiB by default): setting a smaller size would switch autotuning off and cap them lower."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if SOCKET_BUFFER_BYTES and buffer_limit() >= SOCKET_BUFFER_BYTES:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)


def set_timeout(sock: socket.socket, seconds: float) -> None:
    """Every later send and receive on the (blocking) socket fails with EAGAIN after `seconds` without progress."""
    seconds = max(seconds, 0.001)
    whole = int(seconds)
    tv = struct.pack("ll", whole, int((seconds - whole) * 1_000_000))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def _mac(token: bytes, label: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(token, PROTOCOL.encode() + b"\0" + label + b"\0" + first + second, hashlib.sha256).digest()


def _hex(value: object, size: int, what: str, peer: str) -> bytes:
    if isinstance(value, str) and len(value) == 2 * size:
        with contextlib.suppress(ValueError):
            return bytes.fromhex(value)
    raise PeerCorrupt(f"peer {peer}: {what} is not {size} hex bytes")


class Pace:
    """A minimum transfer rate: at least `min_rate` bytes a second, judged over each `window` seconds (the first
    window starts when the transfer does). `min_rate` 0: no minimum."""

    def __init__(self, min_rate: float, window: float = RATE_WINDOW_SECONDS) -> None:
        if min_rate < 0 or window <= 0:
            raise ConfigError("a peer transfer's minimum rate must be >= 0 and its window positive")
        self.min_rate = min_rate
        self.window = window
        self._mark = time.monotonic()
        self._count = 0

    def restart(self) -> None:
        self._mark, self._count = time.monotonic(), 0

    def add(self, nbytes: int, peer: str, what: str) -> None:
        """Count `nbytes` moved; PeerUnavailable when a window closed with fewer bytes than the minimum."""
        self._count += nbytes
        elapsed = time.monotonic() - self._mark
        if self.min_rate and elapsed >= self.window:
            if self._count < self.min_rate * elapsed:
                raise PeerUnavailable(
                    f"peer {peer}: {self._count} bytes in {elapsed:.1f}s while {what}, under the minimum of "
                    f"{self.min_rate:g} bytes/s: cut off"
                )
            self.restart()


class Channel:
    """One connection: frames in both directions, MACed once the session key is set, and the timeouts."""

    def __init__(self, sock: socket.socket, peer: str, timeout: float, server: bool) -> None:
        self.sock = sock
        self.peer = peer
        self.timeout = timeout
        self.key: bytes | None = None
        self.out_label, self.in_label = (b"s", b"c") if server else (b"c", b"s")
        self.sent = 0
        self.received = 0
        self.deadline: float | None = None
        self.allowed = timeout  # what `deadline` allows in all (for the message)
        self.pace: Pace | None = None
        self.waits = timeout  # what the socket's calls wait now (for the messages)
        sock.settimeout(None)
        set_timeout(sock, timeout)

    # -- raw bytes
    @contextlib.contextmanager
    def io(self, what: str) -> Iterator[None]:
        """Socket failures as PeerUnavailable naming the peer and what was going on."""
        try:
            yield
        except PeerError:
            raise
        except (BlockingIOError, TimeoutError) as exc:
            raise PeerUnavailable(f"peer {self.peer}: no progress within {self.waits:g}s while {what}") from exc
        except OSError as exc:
            raise PeerUnavailable(f"peer {self.peer}: connection failed while {what}: {exc.strerror or exc}") from exc

    def arm(self) -> None:
        """Inside the handshake and request (`deadline` set): the next call may wait only what is left of it."""
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise PeerUnavailable(f"peer {self.peer}: did not complete its request within {self.allowed:g}s")
            self.waits = min(self.allowed, self.timeout)
            set_timeout(self.sock, min(left, self.timeout))

    def start_transfer(self, pace: Pace | None) -> None:
        """A step's bytes start to move: no deadline, but `pace` (when it sets a minimum) from now on, and then no
        socket call waits longer than its window (a peer silent that long is under any minimum rate)."""
        self.deadline = None
        self.pace = pace if pace is not None and pace.min_rate > 0 else None
        self.waits = self.timeout if self.pace is None else min(self.timeout, self.pace.window)
        set_timeout(self.sock, self.waits)
        if self.pace is not None:
            self.pace.restart()

    def moved(self, nbytes: int, what: str) -> None:
        """`nbytes` more of a transfer moved (checked against `pace`)."""
        if self.pace is not None:
            self.pace.add(nbytes, self.peer, what)

    def recv_exact(self, size: int, what: str) -> bytes:
        buf = bytearray(size)
        view = memoryview(buf)
        pos = 0
        with self.io(what):
            while pos < size:
                self.arm()
                n = self.sock.recv_into(view[pos:], size - pos, socket.MSG_WAITALL)
                if n == 0:
                    raise PeerUnavailable(f"peer {self.peer}: closed the connection while {what}")
                pos += n
                self.moved(n, what)
        return bytes(buf)

    def sendall(self, data: bytes, what: str) -> None:
        with self.io(what):
            self.arm()
            # a peer gone: EPIPE, never SIGPIPE (a trainer process may not ignore it)
            self.sock.sendall(data, socket.MSG_NOSIGNAL)

    # -- frames
    def _tag(self, label: bytes, seq: int, body: bytes) -> bytes:
        assert self.key is not None
        return hmac.new(self.key, label + seq.to_bytes(8, "big") + body, hashlib.sha256).digest()

    def send_blob(self, body: bytes, what: str = "sending a header") -> None:
        tag = b"" if self.key is None else self._tag(self.out_label, self.sent, body)
        self.sent += 1
        self.sendall(struct.pack(">I", len(body)) + tag + body, what)

    def send(self, header: dict[str, Any]) -> None:
        self.send_blob(json.dumps(header, separators=(",", ":")).encode())

    def recv_blob(
        self, limit: int, what: str = "receiving a header", admit: Callable[[int], None] | None = None
    ) -> bytes:
        """The next frame's body, at most `limit` bytes; `admit(size)` (when given) may refuse the announced size
        before any byte of the body is read."""
        (size,) = struct.unpack(">I", self.recv_exact(4, what))
        if size > limit:
            raise PeerCorrupt(f"peer {self.peer}: announced a {size}-byte frame while {what}, more than {limit}")
        if admit is not None:
            admit(size)
        tag = b"" if self.key is None else self.recv_exact(TAG_BYTES, what)
        body = self.recv_exact(size, what)
        if self.key is not None:
            if not hmac.compare_digest(tag, self._tag(self.in_label, self.received, body)):
                raise PeerCorrupt(f"peer {self.peer}: a frame fails its MAC while {what}")
        self.received += 1
        return body

    def recv(self, what: str = "receiving a header") -> dict[str, Any]:
        body = self.recv_blob(MAX_HEADER_BYTES, what)
        try:
            header = json.loads(body)
        except (ValueError, RecursionError):
            header = None
        if not isinstance(header, dict):
            raise PeerCorrupt(f"peer {self.peer}: a header is not a JSON object while {what}")
        return header

    def raise_error(self, header: dict[str, Any]) -> None:
        """The named error of an error header (`{"error": kind, "message"}`); nothing for another header."""
        if "error" in header:
            kind = _ERROR_KINDS.get(str(header.get("error")), PeerError)
            message = str(header.get("message", ""))[:MAX_MESSAGE]
            raise kind(f"peer {self.peer} answered {str(header['error'])[:40]!r}: {message}")

    def reply(self, what: str, *statuses: str) -> dict[str, Any]:
        """The peer's next header, which must have one of `statuses` (its named error raised otherwise)."""
        header = self.recv(what)
        self.raise_error(header)
        if header.get("status") not in statuses:
            raise PeerCorrupt(f"peer {self.peer}: unexpected answer {short(header)} while {what}")
        return header

    def send_error(self, exc: PeerError) -> None:
        """Best effort: tell the peer why (it may be gone)."""
        kind = next((k for k, cls in _ERROR_KINDS.items() if type(exc) is cls), "refused")
        with contextlib.suppress(OSError, PeerError):
            self.deadline = None
            set_timeout(self.sock, min(self.timeout, 2.0))
            self.send({"error": kind, "message": str(exc)[:MAX_MESSAGE]})

    def linger_close(self) -> None:
        """Close so that a frame just sent is read, not reset away: stop sending, read what the peer still had
        in flight (at most 64 MiB, for at most 1 s), then close."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_WR)
            set_timeout(self.sock, 0.2)
            end, drained = time.monotonic() + 1.0, 0
            buf = bytearray(1 << 20)
            while time.monotonic() < end and drained < 64 << 20:
                n = self.sock.recv_into(buf)
                if n == 0:
                    break
                drained += n
        self.sock.close()


def _connect(address: Address, timeout: float) -> socket.socket:
    host, port = address
    last: OSError | None = None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise PeerUnavailable(f"peer {host}:{port}: cannot resolve: {exc}") from exc
    for family, kind, proto, _, where in infos:
        sock = socket.socket(family, kind, proto)
        try:
            tune(sock)
            sock.settimeout(timeout)
            sock.connect(where)
            return sock
        except OSError as exc:
            sock.close()
            last = exc
    raise PeerUnavailable(f"peer {host}:{port}: cannot connect: {last}")


def client_session(address: Address, token: str, timeout: float) -> Channel:
    """A connection to the peer, both sides authenticated (module doc, steps 1-4)."""
    secret = token_bytes(token)
    sock = _connect(address, timeout)
    ch = Channel(sock, f"{address[0]}:{address[1]}", timeout, server=False)
    try:
        ch.deadline = time.monotonic() + timeout
        hello = ch.recv("waiting for the greeting")
        ch.raise_error(hello)
        if hello.get("proto") != PROTOCOL:
            raise PeerCorrupt(f"peer {ch.peer}: speaks {short(hello.get('proto'))}, not {PROTOCOL}")
        theirs = _hex(hello.get("nonce"), NONCE_BYTES, "the greeting's nonce", ch.peer)
        ours = secrets.token_bytes(NONCE_BYTES)
        ch.send({"nonce": ours.hex(), "mac": _mac(secret, b"client", theirs, ours).hex()})
        proof = ch.recv("authenticating")
        ch.raise_error(proof)
        got = _hex(proof.get("mac"), TAG_BYTES, "the peer's proof", ch.peer)
        if not hmac.compare_digest(got, _mac(secret, b"server", theirs, ours)):
            raise PeerAuthFailed(f"peer {ch.peer} does not know the token (its proof is wrong): nothing was sent")
        ch.key = _mac(secret, b"session", theirs, ours)
        return ch
    except BaseException:
        sock.close()
        raise


def token_bytes(token: str) -> bytes:
    if not isinstance(token, str) or not token:
        raise ConfigError("the peer transport needs a non-empty shared token")
    return token.encode()


def accept_session(ch: Channel, token: bytes) -> None:
    """The server side of the handshake (steps 1-4 above): the client proves it knows the token, then the
    server does, and both derive the session key."""
    ours = secrets.token_bytes(NONCE_BYTES)
    ch.send({"proto": PROTOCOL, "nonce": ours.hex()})
    answer = ch.recv("authenticating")
    theirs = _hex(answer.get("nonce"), NONCE_BYTES, "the client's nonce", ch.peer)
    got = _hex(answer.get("mac"), TAG_BYTES, "the client's proof", ch.peer)
    if not hmac.compare_digest(got, _mac(token, b"client", ours, theirs)):
        raise PeerAuthFailed(f"peer {ch.peer} does not know the token: refused")
    ch.send({"mac": _mac(token, b"server", ours, theirs).hex()})
    ch.key = _mac(token, b"session", ours, theirs)


def named_cause(ch: Channel, cut: PeerUnavailable) -> None:
    """The connection broke while sending: when the peer said why before it closed (an error header waiting
    to be read), raise that named error instead of `cut`."""
    try:
        set_timeout(ch.sock, 1.0)
        header = ch.recv("reading why the peer closed")
    except (PeerError, OSError):
        return
    try:
        ch.raise_error(header)
    except PeerError as named:
        raise named from cut
