"""Start-up checks of what the settings ask of this host, run by `dcs worker` before it takes tasks and by
`dcs doctor` from a trainer's environment.

- memory tier capacity: `memory_tier_bytes` must fit the free space of `memory_dir`'s file system (plus what the
  tier already holds there). A budget the tmpfs cannot hold is refused, not capped: capping would make the
  worker's budget differ from the trainer's (both read the setting), and the saves past the real capacity
  fail with "No space left on device", storage steps included;
- the checkpoint root can be written (a directory: a probe file created and removed; a missing root needs a
  writable parent to be created in);
- an object-store root: the credentials may list the bucket (`write=True`, the worker: put and delete a probe
  object too). An unreachable store is reported but not fatal (`Finding.fatal` False): it may come back, and
  the saves meanwhile fail with `StorageUnavailable`.

Each check returns a `Finding`; `require` raises `PreflightFailed` listing every fatal one.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import PreflightFailed, StorageError, StorageUnavailable
from dcs_tasks.storage import S3Store, s3_settings
from dcs_tasks.storage_url import ObjectURL

MAX_SCANNED_FILES = 100_000  # files of the memory tier counted at most (a bound on a hostile tree)
PROBE_CONNECT_SECONDS = 5.0  # one attempt, these timeouts: a start-up check never waits minutes
PROBE_READ_SECONDS = 10.0


@dataclass(frozen=True)
class Finding:
    """One check's outcome: `problem` empty when it passed; `fatal` False for a problem worth a warning only."""

    check: str
    detail: str
    problem: str = ""
    fatal: bool = True

    @property
    def ok(self) -> bool:
        return not self.problem


def _existing(path: Path) -> Path:
    """`path` or its nearest existing ancestor."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _held_bytes(root: Path) -> int:
    """Bytes the files under `root` occupy (at most MAX_SCANNED_FILES counted; symlinks not followed)."""
    total = scanned = 0
    for dirpath, _, names in os.walk(root):
        for name in names:
            scanned += 1
            if scanned > MAX_SCANNED_FILES:
                return total
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                continue
    return total


def memory_capacity(config: DCSConfig) -> Finding | None:
    """The memory tier's budget against its file system's room (None when the tier is off)."""
    budget = config.memory.budget_bytes
    if budget <= 0:
        return None
    where = Path(config.host.memory_dir)
    try:
        stats = os.statvfs(_existing(where))
    except OSError as exc:
        return Finding("memory tier capacity", str(where), f"cannot stat {where}: {exc}")
    held = _held_bytes(where) if where.is_dir() else 0
    room = stats.f_bavail * stats.f_frsize + held
    detail = f"DCS_MEMORY_TIER_BYTES={budget}, {where} has room for {room} bytes ({held} held by the tier)"
    if budget <= room:
        return Finding("memory tier capacity", detail)
    problem = (
        f"the memory tier's budget DCS_MEMORY_TIER_BYTES={budget} exceeds the {room} bytes its directory "
        f"{where} can hold (free space of its file system plus the tier's own files): saves would fail with "
        f"'No space left on device'. Fix: set DCS_MEMORY_TIER_BYTES to at most {room} on the worker and the "
        "trainer (leave room for the staging buffers in /dev/shm too), grow the tmpfs "
        "(mount -o remount,size=... /dev/shm), or point DCS_MEMORY_DIR at a bigger one"
    )
    return Finding("memory tier capacity", detail, problem)


def _probe_directory(root: Path) -> str:
    """'' when a file can be created (and removed) in `root`, or in its nearest existing ancestor when `root`
    does not exist yet (it is created on the first save); else what went wrong."""
    target = root if root.exists() else _existing(root)
    if not target.is_dir():
        return f"{target} is not a directory"
    probe = target / f".dcs-preflight-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return f"cannot create a file in {target}: {exc.strerror or exc}"
    return ""


def root_writable(config: DCSConfig) -> Finding | None:
    """A directory checkpoint root can be written by this process (None for an object store)."""
    if isinstance(config.checkpoint.dir, ObjectURL):
        return None
    root = Path(os.path.abspath(config.checkpoint.dir))
    failure = _probe_directory(root)
    if not failure:
        return Finding("checkpoint root writable", f"{root} (uid {os.getuid()})")
    problem = (
        f"checkpoint_dir {root} cannot be written by uid {os.getuid()}: {failure}. Fix: point DCS_CHECKPOINT_DIR "
        "at a directory this user may write (the same value for the worker and the trainer), or fix its owner "
        "and mode"
    )
    return Finding("checkpoint root writable", str(root), problem)


def _probe_store(url: ObjectURL, config: DCSConfig, write: bool) -> None:
    quick = dataclasses.replace(
        s3_settings(config), max_attempts=1, connect_timeout=PROBE_CONNECT_SECONDS, read_timeout=PROBE_READ_SECONDS
    )
    store = S3Store(url, quick)
    next(iter(store.objects(url.prefix, limit=1)), None)
    if write:
        key = url.key(f".dcs-preflight-{os.getpid()}-{secrets.token_hex(4)}")
        store.put_small(key, b"")
        store.delete([key])


def object_store(config: DCSConfig, write: bool = False) -> Finding | None:
    """An `s3://` checkpoint root answers with these credentials (None for a directory root)."""
    url = config.checkpoint.dir
    if not isinstance(url, ObjectURL):
        return None
    what = "list, put and delete" if write else "list"
    check = "object store reachable"
    try:
        _probe_store(url, config, write)
    except StorageUnavailable as exc:
        fix = "check DCS_S3_ENDPOINT_URL and that the store is up; saves fail until it answers"
        return Finding(check, str(url), f"{exc}. Fix: {fix}", fatal=False)
    except StorageError as exc:  # denied, no such bucket, anything else the store refused
        fix = (
            "check the AWS credentials of this process (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE), "
            "the bucket's name and policy, and DCS_S3_ENDPOINT_URL"
        )
        return Finding(check, str(url), f"{type(exc).__name__}: {exc}. Fix: {fix}")
    return Finding(check, f"{url} ({what} allowed)")


def run_checks(config: DCSConfig, write: bool = False) -> list[Finding]:
    """Every check that applies to `config` (`write`: the worker's, which writes the store)."""
    checks: list[Callable[[], Finding | None]] = [
        lambda: memory_capacity(config),
        lambda: root_writable(config),
        lambda: object_store(config, write=write),
    ]
    return [found for check in checks if (found := check()) is not None]


def require(config: DCSConfig) -> list[Finding]:
    """The worker's start-up checks: PreflightFailed naming every fatal problem; the findings otherwise (a
    non-fatal problem is for the caller to log)."""
    findings = run_checks(config, write=True)
    fatal = [f.problem for f in findings if not f.ok and f.fatal]
    if fatal:
        raise PreflightFailed("refusing to start:\n  " + "\n  ".join(fatal))
    return findings
