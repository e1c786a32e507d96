"""The paths a worker may act on: only those under its own configured roots.

A task payload comes off the broker, so anyone who can write to Redis could name any path. The payload
models (`dcs_tasks.checkpoint.store.payloads`) already refuse relative paths, `.`/`..` components and bad names;
here each path is checked against this worker's configuration before anything is read or written (workers
and the in-process committer, `dcs_tasks.checkpoint.inline`):
- a step directory must be exactly where a `Checkpointer` with the same `checkpoint_dir` puts that
  step of that run: `<root>/<run>/step-N`, or `<root>/<base>/rank-0000r/step-N` for the shard run
  `<base>.rank-0000r`, compared after resolving symlinks and still under the resolved root;
- a run directory (retention) likewise `<root>/<run>` or `<root>/<base>/rank-0000r`;
- with `replica_dir` set, the replica root is a trusted root too, for the replica task's target step
  directory and for retention's run directory (the same layout as under the checkpoint root); persist and
  commit accept only the checkpoint root;
- a staging file must be a direct child of the resolved `staging_dir` named like the run's staging
  buffers (`dcs-<namespace>-<run>-<pid>-<hex>-<i>.stage`), and is opened with O_NOFOLLOW as a regular file.
Anything else raises `UntrustedPath` (never retried; see `workers.taskbase`).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import overload

from dcs_tasks import hostdirs, storage
from dcs_tasks.checkpoint.format.layout import staging_name_pattern, staging_prefix, step_dir_name
from dcs_tasks.checkpoint.restore.sharded import RANK_DIR
from dcs_tasks.checkpoint.store.payloads import clean_absolute_path, clean_location
from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import UntrustedPath
from dcs_tasks.storage import Location, ObjectPath, store_of
from dcs_tasks.storage.factory import named, within
from dcs_tasks.storage_url import StorageRoot


def _clean(given: str, what: str) -> Path:
    """`given` as a Path when it is absolute and normalised (no `.`/`..`): payload models check this already,
    checked again for paths read from payloads that failed validation."""
    try:
        return Path(clean_absolute_path(given))
    except (ValueError, TypeError) as exc:
        raise UntrustedPath(f"{what}: {exc}") from exc


def _located(given: str, what: str, root: Location) -> Location | None:
    """The location `given` names under `root`'s store, resolved by that store (symlinks on files; an object key
    stays as it is: no links to follow), when it lies strictly under `root`; None when it is not of that store or
    lies elsewhere. `given` must be a clean absolute path or `s3://` URL (UntrustedPath otherwise)."""
    try:
        text = clean_location(given)
    except (ValueError, TypeError) as exc:
        raise UntrustedPath(f"{what}: {exc}") from exc
    loc = named(text, root)
    if loc is None:
        return None
    resolved = store_of(loc).resolve(loc)
    return resolved if resolved != root and within(resolved, root) else None


def _resolve(path: Path) -> Path:
    try:
        return path.resolve()
    except (OSError, RuntimeError) as exc:  # symlink loop, unreadable component
        raise UntrustedPath(f"cannot resolve {str(path)[:256]!r}: {exc}") from exc


def _root(value: StorageRoot, config: DCSConfig) -> Location:
    where = storage.open_root(value, config)
    return store_of(where).resolve(where)  # an object key is taken as it is


def checkpoint_root(config: DCSConfig) -> Location:
    return _root(config.checkpoint.dir, config)


def replica_root(config: DCSConfig) -> Location | None:
    """The resolved replica root, or None when replicas are off."""
    return None if config.checkpoint.replica_dir is None else _root(config.checkpoint.replica_dir, config)


def roots_of(config: DCSConfig, replica: bool) -> list[Location]:
    """The checkpoint root, plus the replica root when `replica` and one is configured."""
    extra = replica_root(config) if replica else None
    return [checkpoint_root(config)] + ([extra] if extra is not None else [])


@overload
def run_dirs(root: Path, run: str) -> list[Path]: ...
@overload
def run_dirs(root: ObjectPath, run: str) -> list[ObjectPath]: ...
def run_dirs(root: Location, run: str) -> list[Path] | list[ObjectPath]:
    """Where run `run` may live under `root`: `<root>/<run>`, and for a shard run `<base>.rank-0000r` also
    `<root>/<base>/rank-0000r` (a plain run may carry such a name too)."""
    base, dot, rank = run.rpartition(".")
    shard = bool(dot and base and RANK_DIR.fullmatch(rank))
    return [root / run, *([root / base / rank] if shard else [])]  # type: ignore[return-value]


def trusted_run_dir(run_dir: str, run: str, config: DCSConfig, *, replica: bool = False) -> Location:
    """`run_dir` resolved, when it is run `run`'s directory under this worker's checkpoint root (or, with
    `replica`, under its replica root), compared after each root's store resolved both (an object URL must be
    exactly that run's)."""
    roots = roots_of(config, replica)
    for root in roots:
        resolved = _located(run_dir, "run directory", root)
        if resolved is None:
            continue
        if resolved not in [store_of(c).resolve(c) for c in run_dirs(root, run)]:
            raise UntrustedPath(f"run directory {run_dir[:256]!r} is not where run {run!r} lives under {str(root)!r}")
        return resolved
    names = " or ".join(repr(str(r)) for r in roots)
    raise UntrustedPath(f"run directory {run_dir[:256]!r} is outside the checkpoint root {names}")


@overload
def trusted_step_dir(step_dir: str, run: str, step: int, config: DCSConfig, *, root: Path) -> Path: ...
@overload
def trusted_step_dir(
    step_dir: str, run: str, step: int, config: DCSConfig, *, root: Location | None = None
) -> Location: ...
def trusted_step_dir(
    step_dir: str, run: str, step: int, config: DCSConfig, *, root: Location | None = None
) -> Location:
    """`step_dir` resolved, when it is step `step` of run `run` under this worker's checkpoint root (or under
    `root`, a root from `roots_of`), compared after the root's store resolved both (an object URL must be exactly
    that step's)."""
    root = checkpoint_root(config) if root is None else root
    resolved = _located(step_dir, "step directory", root)
    if resolved is None:
        raise UntrustedPath(f"step directory {step_dir[:256]!r} is outside the checkpoint root {str(root)!r}")
    expected = [store_of(c).resolve(c / step_dir_name(step)) for c in run_dirs(root, run)]
    if resolved not in expected:
        raise UntrustedPath(
            f"step directory {step_dir[:256]!r} is not where step {step} of run {run!r} lives under {str(root)!r}"
        )
    return resolved


def trusted_save_dir(step_dir: str, run: str, step: int, config: DCSConfig) -> Location:
    """`trusted_step_dir` for a save's step (persist, commit): under the checkpoint root, or, with the memory tier
    on, under `memory_dir` (`dcs_tasks.checkpoint.store.tiers`)."""
    if config.memory.budget_bytes > 0 and not step_dir.startswith("s3://"):
        memory = _resolve(hostdirs.memory_dir(config))  # checked private (UnsafeHostDirectory) when it exists
        if _resolve(_clean(step_dir, "step directory")).is_relative_to(memory):
            return trusted_step_dir(step_dir, run, step, config, root=memory)
    return trusted_step_dir(step_dir, run, step, config)


def trusted_staging_path(staging_path: str, run: str, config: DCSConfig) -> Path:
    """The staging file `staging_path` names, when it is one of run `run`'s buffers in `staging_dir`."""
    staging_dir = _resolve(hostdirs.staging_dir(config))  # checked private (UnsafeHostDirectory) when it exists
    given = _clean(staging_path, "staging file")
    if _resolve(given.parent) != staging_dir:
        raise UntrustedPath(f"staging file {staging_path[:256]!r} is not in the staging directory {str(staging_dir)!r}")
    if not staging_name_pattern(staging_prefix(config.redis.namespace, run)).fullmatch(given.name):
        raise UntrustedPath(f"staging file {staging_path[:256]!r} is not a staging buffer of run {run!r}")
    path = staging_dir / given.name
    if path.is_symlink():
        raise UntrustedPath(f"staging file {staging_path[:256]!r} is a symlink")
    return path


def open_staging(path: Path) -> int:
    """Open a trusted staging path for reading: never through a symlink (O_NOFOLLOW), only a regular file
    (a FIFO or device would block or leak). FileNotFoundError when it is gone."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise UntrustedPath(f"staging file {str(path)!r} is a symlink") from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UntrustedPath(f"staging file {str(path)!r} is not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd
