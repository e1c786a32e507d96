"""The settings a trainer and the `dcs worker` of its host must share, and the check that they do.

Some settings are read by both processes: the trainer stages a save and names its step directory, the worker
trusts only paths under its own roots and keeps (or refuses) memory-tier steps by its own budget. When the two
disagree, nothing fails in the trainer: the worker refuses the tasks (`UntrustedPath`) or quietly does something
else (no memory tier). So each worker publishes what it actually uses (`WorkerSettings`, under
`Keys.worker_settings(queue)`, refreshed with its presence), and a `Checkpointer` compares it with its own at
construction, and again before each save (a worker started or restarted since): `require_agreement` raises
`SettingsMismatch` naming each setting, both values and how to fix it.

Compared: the checkpoint root (resolved; an `s3://` URL and its endpoint), the staging directory and the memory
tier (on or off, budget, directory). `storage_every_steps`/`storage_every_seconds` are the trainer's alone (it picks
which steps go to storage); they are published for `dcs doctor` to show. No published settings (an older worker,
none started yet, Redis unreachable) is no disagreement: `save()` reports a missing worker itself.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import redis
from pydantic import BaseModel, ConfigDict, ValidationError

from dcs_tasks.celery_app import node_queue
from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import SettingsMismatch
from dcs_tasks.keys import Keys
from dcs_tasks.storage.s3 import endpoint_without_credentials  # what S3 uses, and nothing secret to publish
from dcs_tasks.storage_url import ObjectURL

log = logging.getLogger(__name__)

MAX_PUBLISHED_BYTES = 64 * 1024  # a record bigger than this is not read (hostile or damaged)


class WorkerSettings(BaseModel):
    """What one process uses of the settings both sides read: paths resolved, an object root as its URL."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    worker: str = ""
    checkpoint_dir: str
    s3_endpoint_url: str | None = None
    staging_dir: str
    memory_tier_bytes: int = 0
    memory_dir: str = ""
    storage_every_steps: int = 1
    storage_every_seconds: float = 0.0


def _resolved(path: Path) -> str:
    try:
        return str(Path(path).resolve())
    except (OSError, RuntimeError):  # a symlink loop: compare the path as given
        return os.path.abspath(path)


def effective(config: DCSConfig, worker: str = "") -> WorkerSettings:
    """The settings `config` makes this process use, as the other side compares them."""
    root = config.checkpoint.dir  # the configured value: a URL of an object store, or a directory to resolve
    if isinstance(root, ObjectURL):
        where, endpoint = str(root), endpoint_without_credentials(config.s3.endpoint_url)
    else:
        where, endpoint = _resolved(root), None
    return WorkerSettings(
        worker=worker,
        checkpoint_dir=where,
        s3_endpoint_url=endpoint,
        staging_dir=_resolved(config.host.staging_dir),
        memory_tier_bytes=config.memory.budget_bytes,
        memory_dir=_resolved(config.host.memory_dir) if config.memory.budget_bytes > 0 else "",
        storage_every_steps=config.memory.storage_every_steps,
        storage_every_seconds=config.memory.storage_every_seconds,
    )


def read_published(client: redis.Redis, keys: Keys, queue: str) -> WorkerSettings | None:
    """The settings the worker of `queue` published; None when none did (or the record is unreadable)."""
    raw = client.get(keys.worker_settings(queue))
    if raw is None:
        return None
    if len(raw) > MAX_PUBLISHED_BYTES:
        log.warning("ignoring the worker settings of %s: %d bytes", queue, len(raw))
        return None
    try:
        return WorkerSettings.model_validate_json(raw)
    except ValidationError as exc:
        log.warning("ignoring the worker settings of %s: %s", queue, exc.errors(include_input=False)[:1])
        return None


def _env(name: str) -> str:
    return f"DCS_{name.upper()}"


def _both(name: str, mine: object, theirs: object, why: str) -> str:
    return (
        f"{name}: this trainer uses {mine!s}, the worker uses {theirs!s} ({why}). Fix: set {_env(name)}={theirs!s} "
        f"in the trainer's environment, or restart the worker (`dcs worker`, or `dcs up`) with {_env(name)}={mine!s}"
    )


def _memory_lines(mine: WorkerSettings, theirs: WorkerSettings) -> list[str]:
    on_mine, on_theirs = mine.memory_tier_bytes > 0, theirs.memory_tier_bytes > 0
    if on_mine and not on_theirs:
        return [
            f"memory tier: this trainer has DCS_MEMORY_TIER_BYTES={mine.memory_tier_bytes}, the worker runs without "
            "one (0): it refuses every memory-tier step, so every such save fails. Fix: start the worker with the "
            f"same DCS_MEMORY_TIER_BYTES (and DCS_MEMORY_DIR={mine.memory_dir}); with `dcs up`, export them before "
            "`dcs up` (its dcs.env then carries them); or unset DCS_MEMORY_TIER_BYTES in the trainer's environment"
        ]
    if on_theirs and not on_mine:
        return [
            f"memory tier: the worker keeps one of {theirs.memory_tier_bytes} bytes in {theirs.memory_dir}, this "
            "trainer has none (DCS_MEMORY_TIER_BYTES=0): every save would go to storage. Fix: set "
            f"DCS_MEMORY_TIER_BYTES={theirs.memory_tier_bytes} and DCS_MEMORY_DIR={theirs.memory_dir} in the "
            "trainer's environment (`set -a; . dcs.env; set +a` after `dcs up`), or restart the worker without"
        ]
    if not on_mine:
        return []
    lines = []
    if mine.memory_tier_bytes != theirs.memory_tier_bytes:
        why = "the trainer decides which saves fit by its budget, the worker evicts by its own"
        lines.append(_both("memory_tier_bytes", mine.memory_tier_bytes, theirs.memory_tier_bytes, why))
    if mine.memory_dir != theirs.memory_dir:
        why = "the worker refuses memory-tier steps outside its own directory"
        lines.append(_both("memory_dir", mine.memory_dir, theirs.memory_dir, why))
    return lines


def disagreements(mine: WorkerSettings, theirs: WorkerSettings) -> list[str]:
    """One line per setting the trainer (`mine`) and the worker (`theirs`) disagree on, with the fix."""
    lines = []
    if mine.checkpoint_dir != theirs.checkpoint_dir:
        why = "the worker writes only under its own root and refuses the trainer's steps as UntrustedPath"
        lines.append(_both("checkpoint_dir", mine.checkpoint_dir, theirs.checkpoint_dir, why))
    elif mine.s3_endpoint_url != theirs.s3_endpoint_url:
        why = "the worker would write to one object store and the trainer restore from another"
        lines.append(_both("s3_endpoint_url", mine.s3_endpoint_url, theirs.s3_endpoint_url, why))
    if mine.staging_dir != theirs.staging_dir:
        why = "the worker reads staging buffers only from its own staging directory"
        lines.append(_both("staging_dir", mine.staging_dir, theirs.staging_dir, why))
    return lines + _memory_lines(mine, theirs)


def require_agreement(config: DCSConfig, client: redis.Redis, keys: Keys, app: object = None) -> None:
    """SettingsMismatch when the worker serving this host published settings that disagree with `config`.
    Nothing to compare with an in-process committer (`app` with `inline` true), no published settings or Redis
    unreachable."""
    if getattr(app, "inline", False):
        return
    queue = node_queue(config.host_name)
    try:
        theirs = read_published(client, keys, queue)
    except redis.RedisError as exc:  # save() names an unreachable Redis itself
        log.debug("cannot read the worker settings of %s: %s", queue, exc)
        return
    if theirs is None:
        return
    lines = disagreements(effective(config), theirs)
    if lines:
        raise SettingsMismatch(
            f"this trainer's settings disagree with the worker serving {queue} ({theirs.worker or 'unnamed'}):\n  "
            + "\n  ".join(lines)
            + "\n(`dcs doctor` runs this check and the others from the trainer's environment)"
        )
