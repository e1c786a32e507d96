"""The memory tier after a commit (`dcs_tasks.checkpoint.store.tiers`): where a committed step lives, the flush of a
memory step to storage, the copies to peer hosts, eviction. Run by the worker's tasks (`workers/ckpt_tasks.py`, the
worker's `Runtime` as context) or by an in-process committer's threads (`dcs_tasks.checkpoint.inline`); the order
of the steps is `dcs_tasks.checkpoint.aftercommit`'s.

After a memory step commits (`record_commit`): its place `mem@<host>` is recorded, and this host as its owner with
its manifest's digest (`owners.Owners`: peers accept copies only of steps so recorded, by another host); a durable
step is flushed (`flush`: copy to `checkpoint_dir` with `replicating.copy_step`: every file hashed while written and
compared with the manifest, fsynced, headers checked, manifest last; then `latest`, retention and the storage
place); with `memory_replicas` > 0 `peer_copy` pushes the step to peers chosen by `peerchoice.choose_peers`
(`dcs_tasks.checkpoint.store.peers.transfer`: authenticated with the shared token, every file verified on arrival); each
copy's place is recorded once it verified, and `replicated` once every copy asked for did. Every one of these ends
with eviction (`eviction.evict`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any, cast

import redis

from dcs_tasks.checkpoint.format.layout import MANIFEST_NAME
from dcs_tasks.checkpoint.persisting import Context
from dcs_tasks.checkpoint.replicating import complete, copy_step, primary_manifest, publish_copy
from dcs_tasks.checkpoint.store.payloads import MemoryStepRequest
from dcs_tasks.checkpoint.store.peers import transfer
from dcs_tasks.checkpoint.store.tiers import eviction, memdir, owners, peerchoice, stepplaces
from dcs_tasks.checkpoint.telemetry import record_error
from dcs_tasks.checkpoint.trust import checkpoint_root, trusted_step_dir
from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import CheckpointError, ReplicaFailed
from dcs_tasks.storage.factory import relative

log = logging.getLogger(__name__)


def is_memory_step(config: DCSConfig, step_dir: str) -> bool:
    return memdir.enabled(config) and Path(step_dir).is_relative_to(memdir.memory_root(config))


def _memory_step(ctx: Context, req: MemoryStepRequest) -> tuple[Path, str]:
    """(the trusted memory step directory, its path relative to memory_dir)."""
    config = ctx.config
    root = memdir.memory_root(config)
    ref = req.ref
    step_dir = cast(Path, trusted_step_dir(ref.step_dir, ref.run, ref.step, config, root=root))  # under a Path root
    return step_dir, relative(step_dir, root)


def evict(ctx: Context, run: str) -> None:
    try:
        eviction.evict(ctx.config, ctx.redis, ctx.keys, stepplaces.base_and_rank(run)[0])
    except Exception as exc:  # eviction is housekeeping: the next commit tries again
        log.warning("memory tier eviction failed: %s: %s", type(exc).__name__, exc)


def record_commit(ctx: Context, step_dir: str, run: str, step: int, durable: bool) -> tuple[bool, bool]:
    """Record where a just-committed step lives, then evict; returns (flush it, copy it to peers)."""
    config = ctx.config
    base, rank = stepplaces.base_and_rank(run)
    memory = is_memory_step(config, step_dir)
    flush, copy = memory and durable, memory and config.memory.replicas > 0
    place = stepplaces.mem_place(config.host_name) if memory else stepplaces.STORAGE
    marks = [m for m, on in ((stepplaces.FLUSHING, flush), (stepplaces.COPYING, copy)) if on]
    try:
        if memory:  # before the peer copy is sent: the peers check it
            record_owner(ctx, config.host_name, base, step, rank, Path(step_dir))
        stepplaces.Places(ctx.redis, ctx.keys).record(base, step, rank, place, *marks)
    except redis.RedisError as exc:
        log.warning("memory tier: place of step %d of %s not recorded: %s", step, run, exc)
    evict(ctx, run)
    return flush, copy


def record_owner(ctx: Context, host: str, base: str, step: int, rank: int, step_dir: Path) -> None:
    """Record `host` as the owner of its committed memory step (with its manifest's digest)."""
    try:
        raw = (step_dir / MANIFEST_NAME).read_bytes()
    except OSError as exc:
        log.warning("memory tier: owner of step %d of %s not recorded: %s", step, base, exc)
        return
    owners.Owners(ctx.redis, ctx.keys).record(base, step, rank, host, raw)


def flush(ctx: Context, req: MemoryStepRequest, task_id: str) -> dict[str, Any]:
    """Copy a memory step to storage, verified; then `latest`, retention and the storage place."""
    config, ref = ctx.config, req.ref
    src, rel = _memory_step(ctx, req)
    dst = checkpoint_root(config)
    for part in rel.split("/"):
        dst = dst / part
    started = time.monotonic()
    manifest = primary_manifest(src)  # ReplicaFailed when the memory step is gone or corrupt
    copied = 0
    if not complete(dst, manifest):
        copied = copy_step(
            src, dst, manifest, task_id, config.checkpoint.persist_throttle_bytes_per_second, read_back=False
        )
    deleted = publish_copy(ctx, dst, ref.run, ref.step, req.retention, task_id)
    base, rank = stepplaces.base_and_rank(ref.run)
    book = stepplaces.Places(ctx.redis, ctx.keys)
    book.record(base, ref.step, rank, stepplaces.STORAGE, clearing=(stepplaces.FLUSHING,))  # one transaction
    seconds = time.monotonic() - started
    log.info("memory tier: step %d of %s flushed to %s (%d bytes, %.3f s)", ref.step, ref.run, dst, copied, seconds)
    evict(ctx, ref.run)
    return {"step": ref.step, "storage": str(dst), "copied_bytes": copied, "deleted": deleted, "seconds": seconds}


def peer_copy(ctx: Context, req: MemoryStepRequest) -> dict[str, Any]:
    """Push a memory step to `memory_replicas` peers of other failure domains; records each verified copy, and
    `replicated` once all did. A peer that fails is replaced by the next eligible one."""
    ref = req.ref
    base, rank = stepplaces.base_and_rank(ref.run)
    try:
        return _peer_copy(ctx, req)
    finally:
        with contextlib.suppress(redis.RedisError):  # the step may leave memory again
            stepplaces.Places(ctx.redis, ctx.keys).forget(base, ref.step, rank, stepplaces.COPYING)
        evict(ctx, ref.run)


def _peer_copy(ctx: Context, req: MemoryStepRequest) -> dict[str, Any]:
    config, ref = ctx.config, req.ref
    src, rel = _memory_step(ctx, req)
    token = config.token()
    if not token:
        raise ReplicaFailed("memory_replicas needs auth_token (peer copies are authenticated with it)")
    host = config.host_name
    domain = config.memory.failure_domain or host
    candidates = {h: p for h, p in peerchoice.peers(ctx.redis, ctx.keys).items() if h != host}
    ordered = peerchoice.choose_peers(host, domain, candidates, len(candidates))
    base, rank = stepplaces.base_and_rank(ref.run)
    book = stepplaces.Places(ctx.redis, ctx.keys)
    done: list[str] = []
    failures: list[str] = []
    for peer in ordered:
        if len(done) >= config.memory.replicas:
            break
        try:
            transfer.push_step(
                (peer.address, peer.port),
                token,
                src,
                rel,
                timeout=config.peer.timeout_seconds,
                min_rate=config.peer.min_bytes_per_second,
                rate_window=config.peer.rate_window_seconds,
                max_manifest_bytes=config.peer.max_manifest_bytes,
            )
        except CheckpointError as exc:
            failures.append(f"{peer.host}: {exc}")
            log.warning("memory tier: copy of step %d of %s to %s failed: %s", ref.step, ref.run, peer.host, exc)
            continue
        book.record(base, ref.step, rank, stepplaces.peer_place(peer.host))
        done.append(peer.host)
    if len(done) >= config.memory.replicas:  # no longer copying, in the same transaction
        book.record(base, ref.step, rank, stepplaces.REPLICATED, clearing=(stepplaces.COPYING,))
    else:
        record_error("checkpoint_peer_copy")
        log.error(
            "memory tier: step %d of %s has %d of %d peer copies (%s); it does not count as replicated",
            ref.step,
            ref.run,
            len(done),
            config.memory.replicas,
            "; ".join(failures) or "no eligible peer in another failure domain",
        )
    return {"step": ref.step, "peers": done, "failures": failures, "replicated": len(done) >= config.memory.replicas}
