"""`FileStore`: checkpoint bytes as files in a POSIX directory (local disk or a shared file system).

A write goes to a temp name beside the final one (`temp_path`, opened with O_DIRECT where the file system allows
it), is fsynced, renamed over the final name and its directory fsynced: a reader that sees a final name sees
complete, durable bytes, and a crash leaves at most a `.tmp` file, which readers ignore. Files are opened without
following symlinks (`open_regular`). The durable-write helpers here are also what
`checkpoint/store/writes/durable.py` builds its streaming writes on.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import shutil
import stat
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from dcs_tasks.errors import CorruptCheckpoint, StorageError, UntrustedPath
from dcs_tasks.storage.store import Fence, Pieces, Refused, Store, Writer

DIRECT_ALIGN = 4096  # O_DIRECT needs buffer, offset and length aligned to the logical block size
O_DIRECT: int = getattr(os, "O_DIRECT", 0)  # 0 where the platform has none (buffered I/O then)
O_NOFOLLOW: int = getattr(os, "O_NOFOLLOW", 0)
PUT_CHUNK_BYTES = 8 * 1024 * 1024  # one write + hash step of `FileStore.put`
TEMP_GLOB = ".*.tmp"  # matches every `temp_path` (and nothing a reader opens: final names never start with ".")


def is_temp(name: str) -> bool:
    """`name` is a writer's temp name (`temp_path`): never listed, never read."""
    return name.startswith(".") and name.endswith(".tmp")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs_durable(path: Path) -> None:
    """`mkdir -p path`, fsyncing each parent whose entry was created, so the path survives a crash."""
    missing: list[Path] = []
    probe = path
    while not probe.exists():
        missing.append(probe)
        probe = probe.parent
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):
            directory.mkdir()
        fsync_dir(directory.parent)


def temp_path(final: Path, tag: str) -> Path:
    """A temp name of `final`'s that no other writer uses, even one with the same `tag`: a redelivered task
    keeps its task id, and the redelivery can run while the first delivery (or a second redelivery) still
    writes. Two writers sharing one temp file truncate each other's bytes, and the first to rename it would
    publish an inode the other is still truncating and writing (a short final file, seen in CI)."""
    return final.with_name(f".{final.name}.{tag}.{os.getpid()}-{secrets.token_hex(4)}.tmp")


def write_all(fd: int, data: memoryview) -> None:
    pos, size = 0, len(data)
    while pos < size:
        with data[pos:] as rest:  # views over an mmap must be released, or it cannot be closed
            pos += os.write(fd, rest)


def read_exactly(fd: int, size: int) -> bytes:
    """Up to `size` bytes from `fd`'s position (fewer only when the file ends first)."""
    chunks, left = [], size
    while left > 0:
        chunk = os.read(fd, left)
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def open_regular(path: Path) -> int:
    """A read-only descriptor of `path`, which must be a regular file and not a symlink (never followed)."""
    try:
        fd = os.open(path, os.O_RDONLY | O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError as exc:
        raise CorruptCheckpoint(f"checkpoint file {path} is missing", str(path)) from exc
    except OSError as exc:
        why = "is a symlink (never followed)" if exc.errno == errno.ELOOP else f"cannot be opened: {exc.strerror}"
        raise CorruptCheckpoint(f"checkpoint file {path} {why}", str(path)) from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CorruptCheckpoint(f"checkpoint file {path} is not a regular file", str(path))
    return fd


@contextlib.contextmanager
def flocked(directory: Path, name: str, *, shared: bool = False) -> Iterator[None]:
    """Hold an `flock` on the lock file `directory/name` (created when missing; released by the kernel when the
    holder dies). Neither the directory nor the lock file is followed when a symlink (O_NOFOLLOW, the file opened
    relative to the directory's own fd), and the file must be a regular one: a link planted at either name would
    otherwise make the caller create or open a file wherever it points. UntrustedPath names what was there."""
    where = directory / name
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UntrustedPath(f"{str(directory)[:256]!r} is a symlink or not a directory: lock not taken") from exc
        raise
    try:
        flags = os.O_RDONLY | os.O_CREAT | O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(name, flags, 0o644, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
                raise UntrustedPath(f"lock file {str(where)[:256]!r} is a symlink or not a regular file") from exc
            raise
    finally:
        os.close(dir_fd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UntrustedPath(f"lock file {str(where)[:256]!r} is not a regular file")
        fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class FileWriter(Writer):
    """A temp file beside `final` (O_DIRECT for aligned regions when `direct` and the file system allows it)."""

    def __init__(self, final: Path, tag: str, direct: bool) -> None:
        make_dirs_durable(final.parent)
        self.final, self.tmp = final, temp_path(final, tag)
        self.fd: int | None = None
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | os.O_CLOEXEC
        if direct and O_DIRECT:
            try:
                self.fd = os.open(self.tmp, flags | O_DIRECT, 0o644)
            except OSError as exc:  # the file system refuses O_DIRECT (Linux creates the file first): buffered
                if exc.errno != errno.EINVAL:
                    raise
                self.fd = os.open(self.tmp, os.O_WRONLY | os.O_TRUNC | O_NOFOLLOW | os.O_CLOEXEC)
        else:
            self.fd = os.open(self.tmp, flags, 0o644)

    def write(self, view: memoryview) -> None:
        assert self.fd is not None, "write after publish or abort"
        direct = bool(O_DIRECT and fcntl.fcntl(self.fd, fcntl.F_GETFL) & O_DIRECT)
        aligned = len(view) - len(view) % DIRECT_ALIGN if direct else 0
        if aligned:
            try:
                with view[:aligned] as head:
                    write_all(self.fd, head)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                aligned = 0  # the file system took O_DIRECT at open but not this buffer or I/O
        if aligned < len(view):
            if direct:  # the unaligned tail (and everything after it) buffered
                fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~O_DIRECT)
            with view[aligned:] as tail:
                write_all(self.fd, tail)

    def publish(self, check: Callable[[], bool] | None = None) -> None:
        """`check`: asked once the bytes are durable, just before the rename; False raises Refused (aborted)."""
        assert self.fd is not None, "publish after publish or abort"
        try:
            os.fsync(self.fd)
        finally:
            os.close(self.fd)
            self.fd = None
        if check is not None and not check():
            self.abort()
            raise Refused(f"{self.final} was not written: the publish check refused it")
        try:
            os.replace(self.tmp, self.final)
        except BaseException:
            self.abort()
            raise
        self.published = True
        fsync_dir(self.final.parent)

    def abort(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if not self.published:
            self.tmp.unlink(missing_ok=True)


class FileStore(Store[Path]):
    """Files in POSIX directories. `direct`: write with O_DIRECT where the file system allows it."""

    name = "file"
    family = "file"
    direct = True

    def open_writer(self, loc: Path, tag: str) -> Writer:
        return FileWriter(loc, tag, self.direct)

    def make_folder(self, loc: Path) -> None:
        make_dirs_durable(loc)

    def write_small(self, loc: Path, data: bytes, tag: str) -> None:
        with FileWriter(loc, tag, direct=False) as writer:  # a few KiB: O_DIRECT would only cost a retry
            writer.write(memoryview(data))
            writer.publish()

    def put(
        self,
        loc: Path,
        view: memoryview,
        tag: str,
        *,
        hasher: Any = None,
        publish: Callable[[], bool] | None = None,
        on_bytes: Callable[[int], None] | None = None,
    ) -> None:
        writer = FileWriter(loc, tag, self.direct)
        with writer:
            for pos in range(0, len(view), PUT_CHUNK_BYTES):
                with view[pos : pos + PUT_CHUNK_BYTES] as piece:  # released even when the write fails (ENOSPC)
                    if hasher is not None:
                        hasher.update(piece)
                    writer.write(piece)
                if on_bytes is not None:
                    on_bytes(min(PUT_CHUNK_BYTES, len(view) - pos))
            writer.publish(check=publish)

    def lock(
        self, folder: Path, name: str, *, shared: bool = False, fence: Fence | None = None
    ) -> contextlib.AbstractContextManager[None]:
        return flocked(folder, f".{name}.lock", shared=shared)  # the folder's own: a fence is not needed

    def stat(self, loc: Path) -> int | None:
        try:
            found = loc.lstat()
        except OSError:
            return None
        return found.st_size if stat.S_ISREG(found.st_mode) else None

    def exists(self, loc: Path) -> bool:
        return os.path.lexists(loc)

    def names(self, loc: Path) -> list[str]:  # temp names of unpublished writes are not listed
        try:
            with os.scandir(loc) as entries:
                return sorted(e.name for e in entries if not e.is_symlink() and not is_temp(e.name))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def folders_with(self, loc: Path, name: str) -> list[str]:
        try:
            with os.scandir(loc) as entries:
                return sorted(
                    e.name
                    for e in entries
                    if e.is_dir(follow_symlinks=False) and os.path.lexists(os.path.join(e.path, name))
                )
        except (FileNotFoundError, NotADirectoryError):
            return []

    def files(self, loc: Path, limit: int) -> dict[str, int]:
        found: dict[str, int] = {}
        for top, dirs, names in os.walk(loc, followlinks=False):
            rel = os.path.relpath(top, loc)
            for name in (n for n in names if not is_temp(n)):
                info = os.lstat(os.path.join(top, name))
                if stat.S_ISREG(info.st_mode):
                    found[name if rel == "." else f"{rel}/{name}"] = info.st_size
                    if len(found) > limit:
                        raise StorageError(f"{str(loc)[:256]} holds more than {limit} files")
            dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(top, d))]
        return found

    def read_into(self, loc: Path, offset: int, pieces: Pieces) -> None:
        fd = open_regular(loc)
        try:
            pos = offset
            for piece in pieces:
                done = 0
                while done < len(piece):
                    with piece[done:] as rest:
                        n = os.preadv(fd, [rest], pos + done)
                    if not n:
                        raise CorruptCheckpoint(f"checkpoint file {loc} ended early at byte {pos + done}", str(loc))
                    done += n
                pos += len(piece)
        except OSError as exc:
            raise CorruptCheckpoint(f"checkpoint file {loc} cannot be read: {exc.strerror}", str(loc)) from exc
        finally:
            os.close(fd)

    def read_small(self, loc: Path, limit: int) -> bytes:
        fd = open_regular(loc)
        try:
            size = os.fstat(fd).st_size
            if size > limit:
                raise CorruptCheckpoint(f"{loc} has {size} bytes, more than the {limit} it may have", str(loc))
            return read_exactly(fd, size)
        except OSError as exc:
            raise CorruptCheckpoint(f"checkpoint file {loc} cannot be read: {exc.strerror}", str(loc)) from exc
        finally:
            os.close(fd)

    def delete(self, locs: Sequence[Path]) -> None:
        parents: dict[Path, None] = {}
        for loc in locs:
            try:
                loc.unlink()
            except FileNotFoundError:
                continue  # a directory where a file belongs raises (IsADirectoryError): delete_tree removes folders
            parents[loc.parent] = None
        for parent in parents:
            with contextlib.suppress(FileNotFoundError):
                fsync_dir(parent)

    def delete_tree(self, loc: Path, keep: frozenset[str] = frozenset()) -> None:
        if not keep:
            shutil.rmtree(loc, ignore_errors=True)  # never through a symlink: rmtree refuses one
            return
        try:
            children = list(os.scandir(loc))
        except (FileNotFoundError, NotADirectoryError):
            return
        for child in children:
            if child.name in keep:
                continue
            if child.is_dir(follow_symlinks=False):
                shutil.rmtree(child.path, ignore_errors=True)
            else:
                Path(child.path).unlink(missing_ok=True)
        fsync_dir(loc)

    def local_path(self, loc: Path) -> Path | None:
        return loc

    def resolve(self, loc: Path) -> Path:
        try:
            return loc.resolve()
        except (OSError, RuntimeError) as exc:  # symlink loop, unreadable component
            raise UntrustedPath(f"cannot resolve {str(loc)[:256]!r}: {exc}") from exc

    def within(self, loc: Path, root: Path) -> bool:
        return loc.is_relative_to(root)

    def relative(self, loc: Path, root: Path) -> str:
        if loc == root:
            raise ValueError(f"{loc} is not under {root}")
        return loc.relative_to(root).as_posix()

    def sweep(self, loc: Path) -> None:
        for tmp in loc.glob(TEMP_GLOB):
            tmp.unlink(missing_ok=True)
