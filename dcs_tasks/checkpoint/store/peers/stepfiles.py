"""The memory tier's peer transport, its two ends on disk: a step's name on the wire (`rel`, `parse_rel`), its
manifest checked as a memory-tier step, and its directory reached, received, installed and sent by descriptor
(`transfer` runs these over a `channel.Channel`).

A step travels as `rel`, `<run>/step-NNNNNNNNN` or `<run>/rank-NNNNN/step-NNNNNNNNN` (`parse_rel`, checked on
both sides before any path is built). Memory-tier steps are never incremental nor compressed: a manifest naming
a `source_step` or a compression is refused.

Receiving (either side): the manifest is checked before any byte is stored (`validate.check_manifest`; its run,
step and rank are those of `rel`; plain files only; at most the receiver's byte limit). The files go into a
temp directory `<parent>/.incoming-<hex>` next to the target (`INCOMING_PREFIX`; every path component opened
relative to its parent's descriptor with O_NOFOLLOW, so no symlink is ever followed), each hashed on arrival
(received into a reusable buffer with MSG_WAITALL, hashed, written); then the safetensors headers are checked
against the manifest (`stepcheck.check_files`), the seal (`seal.json`: the files were hashed on arrival) and the
manifest are written last, and the directory is renamed into place with RENAME_NOREPLACE: a step committed at
the target is never replaced. On any failure the temp directory is removed, and the run and rank directories made
for it when they are left empty (`prune_parents`). A step received is a peer copy: its seal says so
(`seal.is_peer_copy`), so the memory tier evicts it before its own steps. Nothing is fsynced (the memory tier
lives on tmpfs). Sending: every file opened by descriptor (regular, of its recorded size) and
`sendfile`d, then a trailer `{"done": total bytes}`.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import secrets
import shutil
import socket
import stat
from dataclasses import dataclass
from pathlib import Path

from dcs_tasks.checkpoint.format.layout import MANIFEST_NAME, RANK_DIR, STEP_DIR, Manifest, new_hasher, rank_dir_name
from dcs_tasks.checkpoint.format.layout import step_dir_name as step_dir_name
from dcs_tasks.checkpoint.format.validate import MAX_MANIFEST_BYTES as _VALIDATE_MANIFEST_BYTES
from dcs_tasks.checkpoint.format.validate import check_manifest
from dcs_tasks.checkpoint.store.payloads import run_name_problem
from dcs_tasks.checkpoint.store.peers.channel import MAX_MESSAGE, Channel, short
from dcs_tasks.checkpoint.store.reads.stepcheck import check_files
from dcs_tasks.checkpoint.store.tiers.seal import SEAL_NAME, Stamp, seal_bytes, seal_fd
from dcs_tasks.checkpoint.store.writes.durable import write_all
from dcs_tasks.errors import CorruptCheckpoint, PeerCorrupt, PeerRefused, PeerUnavailable
from dcs_tasks.storage.fs import read_exactly

# A manifest takes ~400 bytes per tensor: a 70B-parameter Llama's full state with Adam's (2,893 tensors) has a
# 1.2 MB manifest; 4 MiB leaves room for ~10,000 tensors per rank. A step with a bigger one is not copied to
# peers (it stays in this host's memory and reaches storage as any other); DCSConfig.peer.max_manifest_bytes.
MAX_MANIFEST_BYTES = min(4 * 1024 * 1024, _VALIDATE_MANIFEST_BYTES)
MAX_FILES = 65536
MAX_REL = 300  # characters of a rel: a run name (128) and two directory names fit with room to spare
RECV_CHUNK_BYTES = 1 << 20  # received, hashed and written per step (one reusable buffer per connection)
INCOMING_PREFIX = ".incoming-"
_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


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
        raise PeerRefused(f"step name {short(rel)} is not a string of at most {MAX_REL} characters")
    parts = rel.split("/")
    if len(parts) not in (2, 3):
        raise PeerRefused(f"step name {short(rel)} is not <run>/step-N or <run>/rank-N/step-N")
    problem = run_name_problem(parts[0])
    if problem is not None:
        raise PeerRefused(f"step name {short(rel)}: {problem}")
    step_match = STEP_DIR.fullmatch(parts[-1])
    if step_match is None or parts[-1] != step_dir_name(int(step_match.group(1))):
        raise PeerRefused(f"step name {short(rel)}: {parts[-1][:40]!r} is not a step directory name")
    rank = None
    if len(parts) == 3:
        rank_match = RANK_DIR.fullmatch(parts[1])
        if rank_match is None or parts[1] != rank_dir_name(int(rank_match.group(1))):
            raise PeerRefused(f"step name {short(rel)}: {parts[1][:40]!r} is not a rank directory name")
        rank = int(rank_match.group(1))
    return StepRel(parts[0], int(step_match.group(1)), rank)


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


# --- step directories, by descriptor ------------------------------------------------------------------------


def open_dir(name: str, dir_fd: int | None, what: str) -> int:
    """A directory descriptor of `name` (relative to `dir_fd`); a symlink or a non-directory is refused."""
    try:
        return os.open(name, _O_DIR, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise PeerRefused(f"{what} is a symlink or not a directory") from exc
        raise


def open_parent(root: Path, rel: StepRel, create: bool) -> int | None:
    """The descriptor of the directory that holds `rel`'s step directory (created when `create`), reached from
    `root` one component at a time without following a symlink; None when absent and not `create`."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for depth, name in enumerate(rel.parts[:-1]):
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o755, dir_fd=fd)
            try:
                child = open_dir(name, fd, "/".join(rel.parts[: depth + 1]))
            except FileNotFoundError:
                os.close(fd)
                return None
            os.close(fd)
            fd = child
        return fd
    except BaseException:
        os.close(fd)
        raise


def is_committed(parent_fd: int, name: str, rel: StepRel) -> bool:
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


def prune_parents(root: Path, rel: StepRel) -> None:
    """Remove `rel`'s rank directory, then its run directory, when empty (a refused or failed step leaves no
    directories behind); every component reached by descriptor without following a link."""
    try:
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        if len(rel.parts) == 3:
            with contextlib.suppress(OSError, PeerRefused):
                run_fd = open_dir(rel.parts[0], root_fd, rel.parts[0])
                try:
                    os.rmdir(rel.parts[1], dir_fd=run_fd)
                finally:
                    os.close(run_fd)
        with contextlib.suppress(OSError):
            os.rmdir(rel.parts[0], dir_fd=root_fd)
    finally:
        os.close(root_fd)


def _remove_temp(parent_fd: int, name: str) -> None:
    """Remove a temp step directory (only regular files inside, removed by name, nothing followed)."""
    with contextlib.suppress(FileNotFoundError):
        fd = open_dir(name, parent_fd, name)
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


def _recv_file(ch: Channel, fd: int, size: int, buf: bytearray, what: str) -> str:
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
                ch.moved(n, what)
            with view[:want] as chunk:
                hasher.update(chunk)
                try:
                    write_all(fd, chunk)
                except OSError as exc:
                    raise LocalWriteError(exc) from exc
            left -= want
    return str(hasher.hexdigest())


def _create(name: str, dir_fd: int) -> int:
    """A new file `name` in the directory `dir_fd`, opened for writing (never an existing one, nor a link)."""
    return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dir_fd)


class LocalWriteError(Exception):
    """A write into the receiving side's own file failed (no room, ...): not the peer's fault."""

    def __init__(self, cause: OSError) -> None:
        super().__init__(str(cause))
        self.cause = cause


def receive_step(ch: Channel, parent: Path, parent_fd: int, rel: StepRel, manifest: Manifest, raw: bytes) -> bool:
    """Receive the step's files (after its manifest `raw`) into a temp directory under `parent_fd` and install it
    as `rel`'s step directory (module doc); False when a committed step got there first (kept, ours removed)."""
    name = rel.parts[-1]
    temp = INCOMING_PREFIX + secrets.token_hex(8)
    os.mkdir(temp, 0o755, dir_fd=parent_fd)
    try:
        temp_fd = open_dir(temp, parent_fd, temp)
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
                    f"peer {ch.peer}: the end of {rel} says {short(trailer)}, not its {manifest.total_bytes} bytes"
                )
            if bad:
                raise PeerCorrupt(f"peer {ch.peer}: {bad[0]}")
            try:
                check_files(parent / temp, manifest)
            except CorruptCheckpoint as exc:
                raise PeerCorrupt(f"peer {ch.peer}: {rel}: {exc}") from exc
            fd = _create(SEAL_NAME, temp_fd)  # every byte was hashed on arrival: a restore need not hash again
            try:
                write_all(fd, memoryview(seal_bytes(stamps, peer=True)))
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
            if is_committed(parent_fd, name, rel):
                _remove_temp(parent_fd, temp)
                return False
            raise PeerRefused(f"{rel}: an uncommitted directory is in the way (another writer?)") from exc
        return True
    except BaseException:
        _remove_temp(parent_fd, temp)
        raise


# --- sending ------------------------------------------------------------------------------------------------


def open_files(step_fd: int, manifest: Manifest, rel: StepRel) -> list[int]:
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


def read_manifest_at(step_fd: int, rel: StepRel, limit: int = MAX_MANIFEST_BYTES) -> bytes | None:
    """The manifest bytes of the step directory `step_fd` (None when it has none: not committed);
    CorruptCheckpoint when it is over `limit` bytes."""
    try:
        fd = os.open(MANIFEST_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=step_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CorruptCheckpoint(f"{rel}/{MANIFEST_NAME} cannot be opened: {exc.strerror}") from exc
    try:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode) or found.st_size > limit:
            raise CorruptCheckpoint(f"{rel}/{MANIFEST_NAME} is not a regular file of at most {limit} bytes")
        return read_exactly(fd, found.st_size)
    finally:
        os.close(fd)


def send_files(ch: Channel, fds: list[int], manifest: Manifest, rel: StepRel) -> int:
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
                ch.moved(sent, f"sending {rel}/{entry.name}")
        total += offset
    ch.send({"done": total})
    return total


# --- listing ----------------------------------------------------------------------------------------------


def committed_steps(root: Path, run: str) -> list[str]:
    """The rels of the committed steps of `run` under `root` (plain and per rank), sorted by rank then step;
    only real directories named as DCS names them count (no symlinks)."""
    found: list[tuple[int, int, str]] = []
    try:
        run_fd = open_parent(root, StepRel(run, 0), create=False)
    except PeerRefused:
        return []
    if run_fd is None:
        return []
    try:
        for name, kind in _entries(run_fd):
            step = _step_of(name)
            if step is not None and kind and is_committed(run_fd, name, StepRel(run, step)):
                found.append((-1, step, str(StepRel(run, step))))
            match = RANK_DIR.fullmatch(name)
            if match and kind and name == rank_dir_name(int(match.group(1))):
                rank = int(match.group(1))
                try:
                    rank_fd = open_dir(name, run_fd, f"{run}/{name}")
                except (PeerRefused, FileNotFoundError):
                    continue
                try:
                    for inner, inner_kind in _entries(rank_fd):
                        step = _step_of(inner)
                        if step is not None and inner_kind and is_committed(rank_fd, inner, StepRel(run, step, rank)):
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
