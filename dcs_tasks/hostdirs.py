"""Host-local directories DCS creates, private to the user DCS runs as.

A host's `/dev/shm` and `/tmp` are shared with every local user: a name DCS computes there, anyone can create
first (a directory of mode 0777 to plant steps in or read them from, a socket that collects the token). So
every socket and directory DCS makes on a host lives under one per-user directory, and every one DCS opens is
checked first, with `os.lstat` (a link is never followed):

- a real directory (not a symlink, not a file),
- owned by the process's effective uid, or by `host_trusted_uid` when that is set (a root worker serving a
  user's trainers, say),
- with no group or other permission bits (mode 0700 or stricter).

Anything else raises `UnsafeHostDirectory` naming the path, what is wrong (the owner's uid, the mode, the link)
and the fix (remove it, or point the setting elsewhere). DCS never chmods, chowns or adopts such a directory.

Contract (other modules build on these; paths are never resolved through links):

- `private_root(config, create=False) -> Path`: the runtime directory, `runtime_dir` (`DCS_RUNTIME_DIR`),
  default `/dev/shm/dcs-<euid>` (`config.default_runtime_dir()`). When it exists it is checked; when missing,
  `create=True` makes it (mode 0700; the parent must exist) and `create=False` returns the path as is, so a
  caller that only cleans up tests `.is_dir()` and finds nothing to do.
- `runtime_path(config) -> Path`: the same path, neither checked nor made (to build names from).
- `check_private_dir(path, allowed_uids=None) -> Path`: the check above on an existing path (`FileNotFoundError`
  when there is none); `allowed_uids` defaults to the euid alone, `allowed_uids(config)` adds the trusted uid.
- `ensure_private_dir(path, allowed_uids=None) -> Path`: `path`, made (0700, with any missing parents, each
  0700) when missing, then checked. A configured directory that exists is checked as it is, never changed.
- `staging_dir(config, create=False)`, `memory_dir(config, create=False)`: the configured directory
  (`staging_dir`, `memory_dir`), default `<runtime_dir>/staging` and `<runtime_dir>/memory`, checked when it
  exists (made first when `create`); missing and not `create`: the path, unchecked.
- `check_socket(path, allowed_uids=None) -> bool`: a host agent's socket path before binding: False when
  nothing is there, True for a socket owned by an allowed uid, `UnsafeHostDirectory` for anything else (another
  user's socket, a file, a link).
- `try_lock(path) -> int | None`: an exclusive `flock` on a lock file (the fd; None while another process holds
  it), safe against a holder that removes the file before letting go.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from collections.abc import Iterable
from pathlib import Path

from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import UnsafeHostDirectory

PRIVATE_MODE = 0o700
_LOOSE_BITS = stat.S_IRWXG | stat.S_IRWXO


def allowed_uids(config: DCSConfig) -> frozenset[int]:
    """The uids whose directories and agent sockets this process trusts: its own, and `host_trusted_uid`."""
    uids = {os.geteuid()}
    if config.host.trusted_uid is not None:
        uids.add(config.host.trusted_uid)
    return frozenset(uids)


def _uids(given: Iterable[int] | None) -> frozenset[int]:
    return frozenset(given) if given is not None else frozenset({os.geteuid()})


def _refuse(path: Path, what: str) -> UnsafeHostDirectory:
    return UnsafeHostDirectory(
        f"{path} {what}: DCS keeps its host-local files private (a directory owned by uid {os.geteuid()}, mode "
        f"0700, no link). Remove it if it is not yours ({path} may be another local user's), or set the "
        "setting that points there (DCS_RUNTIME_DIR, DCS_STAGING_DIR, DCS_MEMORY_DIR, DCS_HOST_AGENT_SOCKET) "
        "to a directory of your own"
    )


def check_private_dir(path: Path, allowed_uids: Iterable[int] | None = None) -> Path:
    """`path` when it is a private directory (module docstring); UnsafeHostDirectory otherwise."""
    st = os.lstat(path)  # FileNotFoundError when missing: the caller decides whether to make it
    if stat.S_ISLNK(st.st_mode):
        raise _refuse(path, f"is a symlink (to {os.readlink(path)!r}), not a directory")
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(path, "is not a directory")
    if st.st_uid not in _uids(allowed_uids):
        raise _refuse(path, f"is owned by uid {st.st_uid}, not by this process's uid {os.geteuid()}")
    if st.st_mode & _LOOSE_BITS:
        raise _refuse(path, f"has mode {stat.S_IMODE(st.st_mode):04o}: group or others may use it")
    return path


def ensure_private_dir(path: Path, allowed_uids: Iterable[int] | None = None) -> Path:
    """`path`, made with mode 0700 (missing parents too) when it does not exist, then checked."""
    missing: list[Path] = []
    probe = path
    while not os.path.lexists(probe) and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, PRIVATE_MODE)  # the umask only takes bits away
        except FileExistsError:
            pass  # made meanwhile (another process of this host): checked below like any existing one
        except OSError as exc:
            if exc.errno != errno.EEXIST:
                raise
    return check_private_dir(path, allowed_uids)


def runtime_path(config: DCSConfig) -> Path:
    """Where the runtime directory is, unchecked (a name to build paths from; check before use)."""
    return config.host.runtime_dir if config.host.runtime_dir is not None else config.default_runtime_dir()


def private_root(config: DCSConfig, create: bool = False) -> Path:
    """The per-user runtime directory (module docstring)."""
    root = runtime_path(config)
    if create:
        return ensure_private_dir(root, allowed_uids(config))
    if os.path.lexists(root):
        check_private_dir(root, allowed_uids(config))
    return root


def _dir(config: DCSConfig, configured: Path | None, name: str, create: bool) -> Path:
    uids = allowed_uids(config)
    root = runtime_path(config)
    if configured is None:
        configured = root / name
    if root in configured.parents:  # a directory under the runtime directory is private only if that is
        private_root(config, create=create)
    if create:
        return ensure_private_dir(configured, uids)
    if os.path.lexists(configured):
        check_private_dir(configured, uids)
    return configured


def staging_dir(config: DCSConfig, create: bool = False) -> Path:
    """The staging buffers' directory: `staging_dir`, default `<runtime_dir>/staging`."""
    return _dir(config, config.host.staging_dir, "staging", create)


def memory_dir(config: DCSConfig, create: bool = False) -> Path:
    """The memory tier's directory: `memory_dir`, default `<runtime_dir>/memory`."""
    return _dir(config, config.host.memory_dir, "memory", create)


def check_socket(path: Path, allowed_uids: Iterable[int] | None = None) -> bool:
    """Whether a socket of an allowed uid is at `path` (False: nothing is); UnsafeHostDirectory for anything
    else there, which a worker must neither bind over nor talk to."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if stat.S_ISLNK(st.st_mode):
        raise _refuse(path, f"is a symlink (to {os.readlink(path)!r}), not the host agent's socket")
    if not stat.S_ISSOCK(st.st_mode):
        raise _refuse(path, "is not a socket")
    if st.st_uid not in _uids(allowed_uids):
        raise _refuse(path, f"is a socket owned by uid {st.st_uid}, not by this process's uid {os.geteuid()}")
    return True


def try_lock(path: Path, attempts: int = 16) -> int | None:
    """An exclusive `flock` on the file `path` (made 0600 when missing, never opened through a link): its fd, or
    None when another process holds it. The lock is on the file `path` names when this returns, so a holder may
    remove the file before it lets go (one that was removed meanwhile is opened anew, at most `attempts` times)."""
    for _ in range(attempts):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            named = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            named = None
        held = os.fstat(fd)
        if named is not None and (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino):
            return fd
        os.close(fd)
    return None
