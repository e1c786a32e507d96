"""The memory tier's peer transport: one committed step directory copied between two hosts' memory tiers.

A `PeerServer` (one per `dcs worker`) serves its memory root (`<root>/<run>/step-N/` or
`<root>/<run>/rank-N/step-N/`, the checkpoint root's layout) over TCP, one thread per connection (at most
`max_connections`). Clients: `push_step` (op `put`: send a step, the server installs it), `pull_step` (op
`get`: fetch a step and install it locally) and `list_steps` (op `list`: the committed steps of a run). A step
travels as `rel`, `<run>/step-NNNNNNNNN` or `<run>/rank-NNNNN/step-NNNNNNNNN` (`parse_rel`, checked on both
sides before any path is built). Memory-tier steps are never incremental nor compressed: a manifest naming a
`source_step` or a compression is refused.

Connection, in order (every header a JSON object in a frame: 4-byte big-endian length, then once the session
key exists a 32-byte HMAC-SHA256 tag, then the JSON; at most `MAX_HEADER_BYTES`, a manifest at most
`MAX_MANIFEST_BYTES`; never pickle):
1. server -> client: `{"proto", "nonce"}` (32 fresh random bytes).
2. client -> server: its own fresh nonce and HMAC(token, "client" + both nonces). A wrong one: the server
   answers `{"error": "auth"}` and closes (PeerAuthFailed), having written nothing.
3. server -> client: HMAC(token, "server" + both nonces): the server proves it knows the token too, before the
   client sends anything about a step (a wrong one: PeerAuthFailed, the client sends nothing more).
4. Both derive the session key HMAC(token, "session" + both nonces); every later frame carries the HMAC of
   (direction, sequence number, body) under it, so headers and manifests cannot be altered or replayed on the
   way. File bytes are not MACed: they are checked against the manifest's xxh3_128 checksums, which are.
5. The request: `{"op": "put", "rel"}` + the manifest, answered `have` (the step is committed there already:
   nothing is sent, nothing replaced) or `send`; or `{"op": "get", "rel", "max_bytes"}`, answered `send` +
   the manifest; or `{"op": "list", "run"}`, answered with the list.
6. For put/get: every file's bytes, raw, in manifest order (the sender `sendfile`s them from the file
   descriptors), then a trailer `{"done": total bytes}`; a put is answered `ok` (installed) or `have` (another
   copy was installed first).

Receiving (either side): the manifest is checked before any byte is stored (`validate.check_manifest`; its run,
step and rank are those of `rel`; plain files only; at most the receiver's byte limit). The files go into a
temp directory `<parent>/.incoming-<hex>` next to the target (`INCOMING_PREFIX`; every path component opened
relative to its parent's descriptor with O_NOFOLLOW, so no symlink is ever followed), each hashed on arrival
(received into a reusable buffer with MSG_WAITALL, hashed, written); then the safetensors headers are checked
against the manifest (`validate.check_files`), the manifest is written last, and the directory is renamed into
place with RENAME_NOREPLACE: a step committed at the target is never replaced. On any failure the temp
directory is removed. Nothing is fsynced (the memory tier lives on tmpfs).

Errors (dcs_tasks.errors): PeerAuthFailed (a PeerRefused), PeerRefused (bad name, over a limit, compressed or
incremental files, no room), PeerCorrupt (bytes, checksums, manifest or frames that do not verify; bytes beyond
those announced), PeerNotFound, PeerUnavailable (unreachable, closed mid-transfer, no answer within `timeout`,
no free connection slot). Every socket call has the timeout (SO_RCVTIMEO/SO_SNDTIMEO); the handshake and the
request must arrive within `timeout` in all. A local step that fails its checks before a push:
CorruptCheckpoint; a local file system failure on the pulling side: its OSError.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import hmac
import json
import logging
import os
import secrets
import shutil
import socket
import stat
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dcs_tasks.checkpoint.format.fsio import read_exactly, write_all
from dcs_tasks.checkpoint.format.layout import MANIFEST_NAME, RANK_DIR, STEP_DIR, Manifest, new_hasher, rank_dir_name
from dcs_tasks.checkpoint.format.layout import step_dir_name as step_dir_name
from dcs_tasks.checkpoint.format.validate import MAX_MANIFEST_BYTES as _VALIDATE_MANIFEST_BYTES
from dcs_tasks.checkpoint.format.validate import check_files, check_manifest
from dcs_tasks.checkpoint.store.payloads import run_name_problem
from dcs_tasks.checkpoint.store.seal import SEAL_NAME, Stamp, seal_bytes, seal_fd
from dcs_tasks.errors import (
    ConfigError,
    CorruptCheckpoint,
    PeerAuthFailed,
    PeerCorrupt,
    PeerError,
    PeerNotFound,
    PeerRefused,
    PeerUnavailable,
)

log = logging.getLogger(__name__)

PROTOCOL = "dcs-peer/1"
MAX_HEADER_BYTES = 64 * 1024
MAX_MANIFEST_BYTES = min(64 * 1024 * 1024, _VALIDATE_MANIFEST_BYTES)
MAX_LIST_BYTES = 4 * 1024 * 1024
MAX_FILES = 65536
MAX_CONNECTIONS = 16
MAX_REL = 300  # characters of a rel: a run name (128) and two directory names fit with room to spare
MAX_MESSAGE = 500  # characters of a peer's error message kept
NONCE_BYTES = 32
TAG_BYTES = 32
RECV_CHUNK_BYTES = 1 << 20  # received, hashed and written per step (one reusable buffer per connection)
SOCKET_BUFFER_BYTES = 16 << 20  # asked for when net.core.[rw]mem_max allow that much, else TCP autotuning
INCOMING_PREFIX = ".incoming-"
STOP_JOIN_SECONDS = 10.0
_ACCEPT_POLL = 0.2
_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_ERROR_KINDS: dict[str, type[PeerError]] = {
    "auth": PeerAuthFailed,
    "refused": PeerRefused,
    "corrupt": PeerCorrupt,
    "not_found": PeerNotFound,
    "unavailable": PeerUnavailable,
}

Address = tuple[str, int]


# --- step names ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepRel:
    """A step's place under a memory root: `<run>/step-N` or `<run>/rank-N/step-N` (`str()` spells it)."""

    run: str
    step: int
    rank: int | None = None

    @property
    def parts(self) -> tuple[str, ...]:
        middle = () if self.rank is None else (rank_dir_name(self.rank),)
        return (self.run, *middle, step_dir_name(self.step))

    def __str__(self) -> str:
        return "/".join(self.parts)


def rel_of(run: str, step: int, rank: int | None = None) -> str:
    """The rel of a step (PeerRefused for a bad run name, step or rank)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise PeerRefused(f"step {step!r} is not an integer >= 0")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank <= 99999):
        raise PeerRefused(f"rank {rank!r} is not an integer 0..99999")
    return str(parse_rel(str(StepRel(run, step, rank))))


def parse_rel(rel: object) -> StepRel:
    """`rel` checked strictly (PeerRefused otherwise): a valid run name (`models.validate_run_name`), optionally
    a rank directory named exactly as `rank_dir_name` names it, then a step directory named exactly as
    `step_dir_name` names it; no other component, so never `..`, an absolute path or an empty component."""
    if not isinstance(rel, str) or len(rel) > MAX_REL:
        raise PeerRefused(f"step name {_short(rel)} is not a string of at most {MAX_REL} characters")
    parts = rel.split("/")
    if len(parts) not in (2, 3):
        raise PeerRefused(f"step name {_short(rel)} is not <run>/step-N or <run>/rank-N/step-N")
    problem = run_name_problem(parts[0])
    if problem is not None:
        raise PeerRefused(f"step name {_short(rel)}: {problem}")
    step_match = STEP_DIR.fullmatch(parts[-1])
    if step_match is None or parts[-1] != step_dir_name(int(step_match.group(1))):
        raise PeerRefused(f"step name {_short(rel)}: {parts[-1][:40]!r} is not a step directory name")
    rank = None
    if len(parts) == 3:
        rank_match = RANK_DIR.fullmatch(parts[1])
        if rank_match is None or parts[1] != rank_dir_name(int(rank_match.group(1))):
            raise PeerRefused(f"step name {_short(rel)}: {parts[1][:40]!r} is not a rank directory name")
        rank = int(rank_match.group(1))
    return StepRel(parts[0], int(step_match.group(1)), rank)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_step_manifest(raw: bytes, rel: StepRel, limit: int) -> Manifest:
    """The manifest of the step `rel` from its bytes, checked as a memory-tier step: CorruptCheckpoint when it
    fails `validate.check_manifest` or names another run, step or rank; PeerRefused when a file is compressed
    or refers to an earlier step, when it lists more than `MAX_FILES` files or more than `limit` bytes."""
    where = Path(str(rel)) / MANIFEST_NAME
    try:
        manifest = Manifest.model_validate_json(raw)
    except ValueError as exc:
        raise CorruptCheckpoint(f"{where} is unreadable: {str(exc)[:MAX_MESSAGE]}", str(where)) from exc
    if len(manifest.files) > MAX_FILES:
        raise PeerRefused(f"{where} lists {len(manifest.files)} files, more than the {MAX_FILES} a step may have")
    for entry in manifest.files:
        if entry.compression is not None or entry.stored_size is not None or entry.source_step is not None:
            raise PeerRefused(
                f"{where}: file {entry.name[:80]!r} is compressed or lies in an earlier step; the memory tier "
                "copies only steps of plain files"
            )
    if manifest.total_bytes > limit:
        raise PeerRefused(f"{where}: the step has {manifest.total_bytes} bytes, more than the {limit} allowed")
    check_manifest(manifest, where)
    if (manifest.run, manifest.step, manifest.rank) != (rel.run, rel.step, rel.rank or 0):
        raise CorruptCheckpoint(
            f"{where} records run {manifest.run[:130]!r} step {manifest.step} rank {manifest.rank}, not "
            f"{rel.run!r} step {rel.step} rank {rel.rank or 0}",
            str(where),
        )
    return manifest


# --- sockets and frames -------------------------------------------------------------------------------------


def _buffer_limit() -> int:
    try:
        return min(int(Path(f"/proc/sys/net/core/{name}_max").read_text()) for name in ("rmem", "wmem"))
    except (OSError, ValueError):
        return 0


def _tune(sock: socket.socket) -> None:
    """TCP_NODELAY; send and receive buffers of `SOCKET_BUFFER_BYTES` when the kernel allows that much. Else
    they are left to TCP's autotuning, which grows them up to net.ipv4.tcp_rmem/tcp_wmem's maximum (32 MiB and
    4 MiB by default): setting a smaller size would switch autotuning off and cap them lower."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if SOCKET_BUFFER_BYTES and _buffer_limit() >= SOCKET_BUFFER_BYTES:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)


def _set_timeout(sock: socket.socket, seconds: float) -> None:
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


class _Channel:
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
        sock.settimeout(None)
        _set_timeout(sock, timeout)

    # -- raw bytes
    @contextlib.contextmanager
    def io(self, what: str) -> Iterator[None]:
        """Socket failures as PeerUnavailable naming the peer and what was going on."""
        try:
            yield
        except PeerError:
            raise
        except (BlockingIOError, TimeoutError) as exc:
            raise PeerUnavailable(f"peer {self.peer}: no progress within {self.timeout:g}s while {what}") from exc
        except OSError as exc:
            raise PeerUnavailable(f"peer {self.peer}: connection failed while {what}: {exc.strerror or exc}") from exc

    def arm(self) -> None:
        """Inside the handshake and request (`deadline` set): the next call may wait only what is left of it."""
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise PeerUnavailable(f"peer {self.peer}: did not complete its request within {self.timeout:g}s")
            _set_timeout(self.sock, min(left, self.timeout))

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

    def recv_blob(self, limit: int, what: str = "receiving a header") -> bytes:
        (size,) = struct.unpack(">I", self.recv_exact(4, what))
        if size > limit:
            raise PeerCorrupt(f"peer {self.peer}: announced a {size}-byte frame while {what}, more than {limit}")
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
            raise PeerCorrupt(f"peer {self.peer}: unexpected answer {_short(header)} while {what}")
        return header

    def send_error(self, exc: PeerError) -> None:
        """Best effort: tell the peer why (it may be gone)."""
        kind = next((k for k, cls in _ERROR_KINDS.items() if type(exc) is cls), "refused")
        with contextlib.suppress(OSError, PeerError):
            self.deadline = None
            _set_timeout(self.sock, min(self.timeout, 2.0))
            self.send({"error": kind, "message": str(exc)[:MAX_MESSAGE]})

    def linger_close(self) -> None:
        """Close so that a frame just sent is read, not reset away: stop sending, read what the peer still had
        in flight (at most 64 MiB, for at most 1 s), then close."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_WR)
            _set_timeout(self.sock, 0.2)
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
            _tune(sock)
            sock.settimeout(timeout)
            sock.connect(where)
            return sock
        except OSError as exc:
            sock.close()
            last = exc
    raise PeerUnavailable(f"peer {host}:{port}: cannot connect: {last}")


def _client_session(address: Address, token: str, timeout: float) -> _Channel:
    """A connection to the peer, both sides authenticated (module doc, steps 1-4)."""
    secret = _token_bytes(token)
    sock = _connect(address, timeout)
    ch = _Channel(sock, f"{address[0]}:{address[1]}", timeout, server=False)
    try:
        ch.deadline = time.monotonic() + timeout
        hello = ch.recv("waiting for the greeting")
        ch.raise_error(hello)
        if hello.get("proto") != PROTOCOL:
            raise PeerCorrupt(f"peer {ch.peer}: speaks {_short(hello.get('proto'))}, not {PROTOCOL}")
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


def _token_bytes(token: str) -> bytes:
    if not isinstance(token, str) or not token:
        raise ConfigError("the peer transport needs a non-empty shared token")
    return token.encode()


# --- step directories, by descriptor ------------------------------------------------------------------------


def _open_dir(name: str, dir_fd: int | None, what: str) -> int:
    """A directory descriptor of `name` (relative to `dir_fd`); a symlink or a non-directory is refused."""
    try:
        return os.open(name, _O_DIR, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise PeerRefused(f"{what} is a symlink or not a directory") from exc
        raise


def _open_parent(root: Path, rel: StepRel, create: bool) -> int | None:
    """The descriptor of the directory that holds `rel`'s step directory (created when `create`), reached from
    `root` one component at a time without following a symlink; None when absent and not `create`."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for depth, name in enumerate(rel.parts[:-1]):
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o755, dir_fd=fd)
            try:
                child = _open_dir(name, fd, "/".join(rel.parts[: depth + 1]))
            except FileNotFoundError:
                os.close(fd)
                return None
            os.close(fd)
            fd = child
        return fd
    except BaseException:
        os.close(fd)
        raise


def _committed(parent_fd: int, name: str, rel: StepRel) -> bool:
    """Whether `name` under `parent_fd` is a committed step (a real directory holding a manifest)."""
    try:
        found = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if not stat.S_ISDIR(found.st_mode):
        raise PeerRefused(f"{rel} is a symlink or not a directory")
    return os.path.lexists(f"/proc/self/fd/{parent_fd}/{name}/{MANIFEST_NAME}")


_LIBC = ctypes.CDLL(None, use_errno=True)
_RENAMEAT2 = getattr(_LIBC, "renameat2", None)
if _RENAMEAT2 is not None:
    _RENAMEAT2.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    _RENAMEAT2.restype = ctypes.c_int
_RENAME_NOREPLACE = 1


def _rename_noreplace(dir_fd: int, src: str, dst: str) -> None:
    """Rename `src` to `dst` (both in `dir_fd`), FileExistsError when `dst` exists (an empty directory too)."""
    if _RENAMEAT2 is not None:
        if _RENAMEAT2(dir_fd, src.encode(), dir_fd, dst.encode(), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.ENOSYS, errno.EINVAL):
            raise FileExistsError(err, os.strerror(err), dst) if err == errno.EEXIST else OSError(err, os.strerror(err))
    if os.path.lexists(f"/proc/self/fd/{dir_fd}/{dst}"):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), dst)
    os.rename(src, dst, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def _remove_temp(parent_fd: int, name: str) -> None:
    """Remove a temp step directory (only regular files inside, removed by name, nothing followed)."""
    with contextlib.suppress(FileNotFoundError):
        fd = _open_dir(name, parent_fd, name)
        try:
            for child in os.listdir(fd):
                with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                    os.unlink(child, dir_fd=fd)
        finally:
            os.close(fd)
        os.rmdir(name, dir_fd=parent_fd)


def remove_stale_incoming(root: Path) -> int:
    """Remove the temp directories (`INCOMING_PREFIX`) that receivers which died left under `root`'s runs and
    their rank directories; the number removed. Call only while no receiver works on `root`."""
    removed = 0
    parents = [p for p in root.iterdir() if p.is_dir() and not p.is_symlink()] if root.is_dir() else []
    parents += [r for p in list(parents) for r in p.iterdir() if RANK_DIR.fullmatch(r.name) and not r.is_symlink()]
    for parent in parents:
        for child in parent.glob(INCOMING_PREFIX + "*"):
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
                removed += 1
    return removed


def _recv_file(ch: _Channel, fd: int, size: int, buf: bytearray, what: str) -> str:
    """Receive `size` bytes into the open file `fd`, hashing them on the way; their checksum."""
    hasher = new_hasher()
    view = memoryview(buf)
    sock = ch.sock
    left = size
    with ch.io(what):
        while left:
            want = min(left, len(buf))
            pos = 0
            while pos < want:
                n = sock.recv_into(view[pos:want], want - pos, socket.MSG_WAITALL)
                if n == 0:
                    raise PeerUnavailable(
                        f"peer {ch.peer}: closed the connection while {what}, {size - left + pos} of {size} bytes in"
                    )
                pos += n
            with view[:want] as chunk:
                hasher.update(chunk)
                try:
                    write_all(fd, chunk)
                except OSError as exc:
                    raise _LocalWriteError(exc) from exc
            left -= want
    return str(hasher.hexdigest())


def _create(name: str, dir_fd: int) -> int:
    """A new file `name` in the directory `dir_fd`, opened for writing (never an existing one, nor a link)."""
    return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dir_fd)


class _LocalWriteError(Exception):
    """A write into the receiving side's own file failed (no room, ...): not the peer's fault."""

    def __init__(self, cause: OSError) -> None:
        super().__init__(str(cause))
        self.cause = cause


def _receive_step(ch: _Channel, parent: Path, parent_fd: int, rel: StepRel, manifest: Manifest, raw: bytes) -> bool:
    """Receive the step's files (after its manifest `raw`) into a temp directory under `parent_fd` and install it
    as `rel`'s step directory (module doc); False when a committed step got there first (kept, ours removed)."""
    name = rel.parts[-1]
    temp = INCOMING_PREFIX + secrets.token_hex(8)
    os.mkdir(temp, 0o755, dir_fd=parent_fd)
    try:
        temp_fd = _open_dir(temp, parent_fd, temp)
        bad: list[str] = []
        try:
            buf = bytearray(min(RECV_CHUNK_BYTES, max((f.size for f in manifest.files), default=1)) or 1)
            stamps: dict[str, Stamp] = {}
            for entry in manifest.files:
                fd = _create(entry.name, temp_fd)
                try:
                    got = _recv_file(ch, fd, entry.size, buf, f"receiving {rel}/{entry.name}")
                    stamps[entry.name] = seal_fd(fd)  # trusted only once the checks below pass (seal.json then)
                finally:
                    os.close(fd)
                if got != entry.checksum and not bad:
                    bad.append(f"{rel}/{entry.name} has checksum {got}, its manifest says {entry.checksum}")
            trailer = ch.recv(f"receiving the end of {rel}")
            if trailer.get("done") != manifest.total_bytes:
                raise PeerCorrupt(
                    f"peer {ch.peer}: the end of {rel} says {_short(trailer)}, not its {manifest.total_bytes} bytes"
                )
            if bad:
                raise PeerCorrupt(f"peer {ch.peer}: {bad[0]}")
            try:
                check_files(parent / temp, manifest)
            except CorruptCheckpoint as exc:
                raise PeerCorrupt(f"peer {ch.peer}: {rel}: {exc}") from exc
            fd = _create(SEAL_NAME, temp_fd)  # every byte was hashed on arrival: a restore need not hash again
            try:
                write_all(fd, memoryview(seal_bytes(stamps)))
            finally:
                os.close(fd)
            fd = _create(MANIFEST_NAME, temp_fd)
            try:
                write_all(fd, memoryview(raw))
            finally:
                os.close(fd)
        finally:
            os.close(temp_fd)
        try:
            _rename_noreplace(parent_fd, temp, name)
        except (FileExistsError, OSError) as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            if _committed(parent_fd, name, rel):
                _remove_temp(parent_fd, temp)
                return False
            raise PeerRefused(f"{rel}: an uncommitted directory is in the way (another writer?)") from exc
        return True
    except BaseException:
        _remove_temp(parent_fd, temp)
        raise


# --- sending ------------------------------------------------------------------------------------------------


def _open_files(step_fd: int, manifest: Manifest, rel: StepRel) -> list[int]:
    """A read descriptor of each file of the step (regular, not a symlink, of its recorded size)."""
    fds: list[int] = []
    try:
        for entry in manifest.files:
            try:
                fd = os.open(entry.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=step_fd)
            except OSError as exc:
                raise CorruptCheckpoint(f"{rel}/{entry.name} cannot be opened: {exc.strerror}") from exc
            fds.append(fd)
            found = os.fstat(fd)
            if not stat.S_ISREG(found.st_mode) or found.st_size != entry.size:
                raise CorruptCheckpoint(f"{rel}/{entry.name} is not a regular file of {entry.size} bytes")
        return fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _read_manifest_at(step_fd: int, rel: StepRel) -> bytes | None:
    """The manifest bytes of the step directory `step_fd` (None when it has none: not committed)."""
    try:
        fd = os.open(MANIFEST_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=step_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CorruptCheckpoint(f"{rel}/{MANIFEST_NAME} cannot be opened: {exc.strerror}") from exc
    try:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode) or found.st_size > MAX_MANIFEST_BYTES:
            raise CorruptCheckpoint(
                f"{rel}/{MANIFEST_NAME} is not a regular file of at most {MAX_MANIFEST_BYTES} bytes"
            )
        return read_exactly(fd, found.st_size)
    finally:
        os.close(fd)


def _send_files(ch: _Channel, fds: list[int], manifest: Manifest, rel: StepRel) -> int:
    """`sendfile` every file, then the trailer; the bytes sent."""
    total = 0
    sock_fd = ch.sock.fileno()
    for fd, entry in zip(fds, manifest.files, strict=True):
        offset = 0
        with ch.io(f"sending {rel}/{entry.name}"):
            while offset < entry.size:
                sent = os.sendfile(sock_fd, fd, offset, entry.size - offset)
                if sent == 0:  # the file shrank under us: the peer will find the stream short and refuse it
                    raise CorruptCheckpoint(f"{rel}/{entry.name} shrank to {offset} bytes while being sent")
                offset += sent
        total += offset
    ch.send({"done": total})
    return total


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
        self._token = _token_bytes(token)
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
            _tune(listener)
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
            ch = _Channel(sock, peer, min(self.timeout, 1.0), server=True)
            ch.send_error(PeerUnavailable(f"all {self.max_connections} connection slots are busy"))
        sock.close()

    def _serve(self, sock: socket.socket, peer: str) -> None:
        try:
            _tune(sock)
            ch = _Channel(sock, peer, self.timeout, server=True)
            try:
                ch.deadline = time.monotonic() + self.timeout
                self._authenticate(ch)
                request = ch.recv("receiving the request")
                op = request.get("op")
                if op == "put":
                    self._put(ch, request)
                elif op == "get":
                    self._get(ch, request)
                elif op == "list":
                    self._list(ch, request)
                else:
                    raise PeerRefused(f"unknown operation {_short(op)}")
                sock.close()
            except PeerError as exc:
                self._failed(ch, exc)
            except CorruptCheckpoint as exc:
                self._failed(ch, PeerCorrupt(str(exc)))
            except _LocalWriteError as exc:
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

    def _failed(self, ch: _Channel, exc: PeerError) -> None:
        self.errors.append(exc)
        log.warning("peer server: request from %s failed: %s", ch.peer, exc)
        if isinstance(exc, PeerUnavailable):
            ch.sock.close()
            return
        ch.send_error(exc)
        ch.linger_close()

    def _authenticate(self, ch: _Channel) -> None:
        ours = secrets.token_bytes(NONCE_BYTES)
        ch.send({"proto": PROTOCOL, "nonce": ours.hex()})
        answer = ch.recv("authenticating")
        theirs = _hex(answer.get("nonce"), NONCE_BYTES, "the client's nonce", ch.peer)
        got = _hex(answer.get("mac"), TAG_BYTES, "the client's proof", ch.peer)
        if not hmac.compare_digest(got, _mac(self._token, b"client", ours, theirs)):
            raise PeerAuthFailed(f"peer {ch.peer} does not know the token: refused")
        ch.send({"mac": _mac(self._token, b"server", ours, theirs).hex()})
        ch.key = _mac(self._token, b"session", ours, theirs)

    def _put(self, ch: _Channel, request: dict[str, Any]) -> None:
        rel = parse_rel(request.get("rel"))
        raw = ch.recv_blob(MAX_MANIFEST_BYTES, f"receiving the manifest of {rel}")
        manifest = check_step_manifest(raw, rel, self.max_step_bytes)
        parent_fd = _open_parent(self.root, rel, create=True)
        assert parent_fd is not None
        try:
            if _committed(parent_fd, rel.parts[-1], rel):
                ch.send({"status": "have"})
                return
            ch.send({"status": "send"})
            ch.deadline = None
            installed = _receive_step(ch, self.root.joinpath(*rel.parts[:-1]), parent_fd, rel, manifest, raw)
        finally:
            os.close(parent_fd)
        ch.send({"status": "ok" if installed else "have", "bytes": manifest.total_bytes})
        log.info("peer server: %s %s from %s", "installed" if installed else "already had", rel, ch.peer)
        if installed and self.on_installed is not None:
            try:
                self.on_installed(str(rel))
            except Exception:  # the step is installed and the peer told so: a failing hook is only logged
                log.exception("peer server: on_installed(%r) failed", str(rel))

    def _get(self, ch: _Channel, request: dict[str, Any]) -> None:
        rel = parse_rel(request.get("rel"))
        limit = request.get("max_bytes")
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise PeerRefused(f"max_bytes {_short(limit)} is not an integer >= 0")
        parent_fd = _open_parent(self.root, rel, create=False)
        if parent_fd is None:
            raise PeerNotFound(f"no step {rel} here")
        try:
            try:
                step_fd = _open_dir(rel.parts[-1], parent_fd, str(rel))
            except FileNotFoundError as exc:
                raise PeerNotFound(f"no step {rel} here") from exc
        finally:
            os.close(parent_fd)
        try:
            raw = _read_manifest_at(step_fd, rel)
            if raw is None:
                raise PeerNotFound(f"step {rel} is not committed here")
            manifest = check_step_manifest(raw, rel, min(limit, self.max_step_bytes))
            fds = _open_files(step_fd, manifest, rel)
        finally:
            os.close(step_fd)
        try:
            ch.send({"status": "send"})
            ch.send_blob(raw, f"sending the manifest of {rel}")
            ch.deadline = None
            _send_files(ch, fds, manifest, rel)
        finally:
            for fd in fds:
                os.close(fd)

    def _list(self, ch: _Channel, request: dict[str, Any]) -> None:
        run = request.get("run")
        problem = run_name_problem(run)
        if problem is not None:
            raise PeerRefused(problem)
        assert isinstance(run, str)
        ch.send({"status": "list"})
        ch.send_blob(json.dumps(committed_steps(self.root, run)).encode(), "sending the list")


def committed_steps(root: Path, run: str) -> list[str]:
    """The rels of the committed steps of `run` under `root` (plain and per rank), sorted by rank then step;
    only real directories named as DCS names them count (no symlinks)."""
    found: list[tuple[int, int, str]] = []
    try:
        run_fd = _open_parent(root, StepRel(run, 0), create=False)
    except PeerRefused:
        return []
    if run_fd is None:
        return []
    try:
        for name, kind in _entries(run_fd):
            step = _step_of(name)
            if step is not None and kind and _committed(run_fd, name, StepRel(run, step)):
                found.append((-1, step, str(StepRel(run, step))))
            match = RANK_DIR.fullmatch(name)
            if match and kind and name == rank_dir_name(int(match.group(1))):
                rank = int(match.group(1))
                try:
                    rank_fd = _open_dir(name, run_fd, f"{run}/{name}")
                except (PeerRefused, FileNotFoundError):
                    continue
                try:
                    for inner, inner_kind in _entries(rank_fd):
                        step = _step_of(inner)
                        if step is not None and inner_kind and _committed(rank_fd, inner, StepRel(run, step, rank)):
                            found.append((rank, step, str(StepRel(run, step, rank))))
                finally:
                    os.close(rank_fd)
    finally:
        os.close(run_fd)
    return [rel for _, _, rel in sorted(found)]


def _entries(dir_fd: int) -> list[tuple[str, bool]]:
    """(name, is a real directory) of each entry of the directory `dir_fd`."""
    with os.scandir(dir_fd) as entries:
        return [(entry.name, entry.is_dir(follow_symlinks=False)) for entry in entries]


def _step_of(name: str) -> int | None:
    match = STEP_DIR.fullmatch(name)
    if match is None or name != step_dir_name(int(match.group(1))):
        return None
    return int(match.group(1))


# --- clients ------------------------------------------------------------------------------------------------


def push_step(address: Address, token: str, step_dir: Path, rel: str, *, timeout: float) -> int:
    """Send the committed step at `step_dir` to the peer at `address`, which installs it as `rel`; the bytes of
    file data sent (0 when the peer said it holds the step already, before any byte went: it is never replaced;
    a copy that another one beat to the rename counts its bytes and leaves the first in place). The local step is
    checked first (CorruptCheckpoint: its manifest fails the checks, names another step than `rel`, or a file is
    not a regular file of its recorded size; PeerRefused: it is compressed or incremental)."""
    step = parse_rel(rel)
    step_fd = _open_dir(str(step_dir), None, str(step_dir))
    try:
        raw = _read_manifest_at(step_fd, step)
        if raw is None:
            raise CorruptCheckpoint(f"{step_dir} has no {MANIFEST_NAME}: it is not a committed step", str(step_dir))
        manifest = check_step_manifest(raw, step, 1 << 62)
        fds = _open_files(step_fd, manifest, step)
    finally:
        os.close(step_fd)
    try:
        ch = _client_session(address, token, timeout)
        try:
            ch.send({"op": "put", "rel": str(step)})
            ch.send_blob(raw, f"sending the manifest of {step}")
            if ch.reply(f"offering {step}", "have", "send")["status"] == "have":
                return 0
            ch.deadline = None
            try:
                sent = _send_files(ch, fds, manifest, step)
            except PeerUnavailable as exc:
                _named_cause(ch, exc)
                raise
            ch.reply(f"waiting for the peer to install {step}", "ok", "have")
            return sent
        finally:
            ch.sock.close()
    finally:
        for fd in fds:
            os.close(fd)


def _named_cause(ch: _Channel, cut: PeerUnavailable) -> None:
    """The connection broke while sending: when the peer said why before it closed (an error header waiting
    to be read), raise that named error instead of `cut`."""
    try:
        _set_timeout(ch.sock, 1.0)
        header = ch.recv("reading why the peer closed")
    except (PeerError, OSError):
        return
    try:
        ch.raise_error(header)
    except PeerError as named:
        raise named from cut


def pull_step(address: Address, token: str, rel: str, dest_root: Path, *, timeout: float, max_bytes: int) -> Path:
    """Fetch the step `rel` from the peer at `address` and install it, verified, as `dest_root/rel` (module doc:
    temp directory, checksums, manifest last, atomic rename); its path. A step already committed there is kept
    and returned without asking the peer. PeerRefused when the step has more than `max_bytes` bytes."""
    step = parse_rel(rel)
    dest_root = Path(dest_root)
    dest_root.mkdir(parents=True, exist_ok=True)
    final = dest_root.joinpath(*step.parts)
    parent_fd = _open_parent(dest_root, step, create=True)
    assert parent_fd is not None
    try:
        if _committed(parent_fd, step.parts[-1], step):
            return final
        ch = _client_session(address, token, timeout)
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
                _receive_step(ch, final.parent, parent_fd, step, manifest, raw)
            except _LocalWriteError as exc:
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
    ch = _client_session(address, token, timeout)
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
