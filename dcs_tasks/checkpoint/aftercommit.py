"""What follows a commit: one chain, run by a host's `dcs worker` (each follow-up a Celery task of its own,
`workers/ckpt_tasks.py`) and by an in-process committer (each follow-up a job on its threads,
`dcs_tasks.checkpoint.inline`). Both call the functions here with their context (`persisting.Context`: the
worker's `Runtime`, or the `InlineCommitter`), so the two cannot drift apart.

The order, once a commit wrote its step (`persisting.commit` returned WRITE), is `after_commit`'s:

- a step committed in the memory tier (`ref.step_dir` under `memory_dir`): its place and owner are recorded and
  eviction runs (`tiering.record_commit`); then, independently of each other, the copies to `memory_replicas`
  peers (`tiering.peer_copy`) and, for a durable save, the flush to storage (`tiering.flush`: copy, `latest`,
  retention of the storage run directory, the storage place; eviction). After a flush, `after_flush` names the
  replica of the stored step (`replica_dir` set), copied as below. A flush that fails for good is recorded for the
  trainer (`flush_failed`); a peer copy that falls short is logged and counted, the step stays in memory.
- a step committed in storage: its place is recorded when the memory tier is on; then, independently of each
  other, retention of its run directory (`retain`, when the run has a policy) and its replica (`replicating`,
  when `replica_dir` is set; the replica copy applies retention to the replica run directory itself).

A follow-up never fails the commit before it: the step is committed whatever happens after.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from dcs_tasks.checkpoint import persisting, tiering
from dcs_tasks.checkpoint.persisting import Context
from dcs_tasks.checkpoint.store.ledger.retention import apply_retention, in_flight_refs
from dcs_tasks.checkpoint.store.payloads import (
    CommitRequest,
    MemoryStepRequest,
    ReplicateRequest,
    RetentionRequest,
)
from dcs_tasks.checkpoint.store.tiers import memdir
from dcs_tasks.checkpoint.telemetry import record_error
from dcs_tasks.checkpoint.trust import checkpoint_root, replica_root, trusted_run_dir, trusted_step_dir
from dcs_tasks.storage.factory import relative

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FollowUps:
    """What to run after a commit, each independent of the others (None: nothing of that kind)."""

    peer_copy: MemoryStepRequest | None = None
    flush: MemoryStepRequest | None = None
    retention: RetentionRequest | None = None
    replica: ReplicateRequest | None = None


def after_commit(ctx: Context, req: CommitRequest) -> FollowUps:
    """Record where the step `req` just committed lives and name what follows (see the module docstring)."""
    ref = req.ref
    if tiering.is_memory_step(ctx.config, ref.step_dir):  # retention and replicas follow the flush to storage
        flush, copy = tiering.record_commit(ctx, ref.step_dir, ref.run, ref.step, req.durable)
        step = MemoryStepRequest(ref=ref, retention=req.retention)
        return FollowUps(peer_copy=step if copy else None, flush=step if flush else None)
    if memdir.enabled(ctx.config):
        tiering.record_commit(ctx, ref.step_dir, ref.run, ref.step, True)
    retention = None
    if req.retention.active:
        retention = RetentionRequest(run=ref.run, run_dir=ref.step_dir.rpartition("/")[0], policy=req.retention)
    return FollowUps(retention=retention, replica=replica_request(ctx, req))


def after_flush(ctx: Context, req: MemoryStepRequest, storage_dir: str) -> ReplicateRequest | None:
    """The replica of a memory step just flushed to `storage_dir`, or None (no `replica_dir`)."""
    stored = CommitRequest(ref=req.ref.model_copy(update={"step_dir": storage_dir}), retention=req.retention)
    return replica_request(ctx, stored)


def replica_request(ctx: Context, req: CommitRequest) -> ReplicateRequest | None:
    """The replica copy of the step `req` committed, or None: no `replica_dir`, or the request cannot be made
    (logged and counted: the commit stands, the replica is best effort; `dcs ckpt list` shows the step as
    primary only)."""
    config, ref = ctx.config, req.ref
    if config.checkpoint.replica_dir is None:
        return None
    try:
        root, replica = checkpoint_root(config), replica_root(config)
        assert replica is not None
        source = trusted_step_dir(ref.step_dir, ref.run, ref.step, config, root=root)
        target = replica
        for part in relative(source, root).split("/"):
            target = target / part
        return ReplicateRequest(
            run=ref.run, step=ref.step, step_dir=ref.step_dir, replica_step_dir=str(target), retention=req.retention
        )
    except Exception as exc:  # the primary commit is done and must not fail because of its replica
        replica_not_sent(ref.run, ref.step, exc)
        return None


def replica_not_sent(run: str, step: int, exc: BaseException) -> None:
    record_error("checkpoint_replica")
    log.error("replica of step %d of run %s not sent: %s: %s", step, run, type(exc).__name__, exc)


def retain(ctx: Context, req: RetentionRequest) -> list[int]:
    """Apply the run's policy to its run directory (under the checkpoint root or the replica root, else
    UntrustedPath), sparing steps the ledger still has in flight and the files they (and kept steps) refer to;
    returns the steps let go."""
    run_dir = trusted_run_dir(req.run_dir, req.run, ctx.config, replica=True)
    book = persisting.ledger(ctx)
    lock = persisting.object_lock(ctx)
    return apply_retention(
        run_dir,
        req.policy,
        book.in_flight_steps(req.run),
        lambda: in_flight_refs(book, req.run),
        object_lock=lambda where: lock(where, "refs"),
    )


def flush_failed(ctx: Context, run: str, step: int, reason: str) -> None:
    """A memory step's flush to storage failed for good: the step is in memory only, so a save asked to be durable
    is not; recorded for the trainer's next save()/close() (`dcs_tasks.checkpoint.failures`)."""
    if not persisting.ledger(ctx).record_flush_failure(run, step, reason, time.time()):
        log.error("flush failures of run %r not recorded: too many already", run)
