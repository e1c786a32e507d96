"""Which memory-tier steps leave memory, and removing them (store stage: no torch).

Eviction (`evictable`): per run and rank directory in memory, the newest complete step never leaves, nor a step
being flushed or copied (a flush that failed for good leaves its mark: the step stays, safe but held); the
`memory_keep_last` newest stay; an older step leaves once a copy of it, or of a newer step of the same rank,
exists in storage or in a peer's memory (then losing it loses no recovery point that nothing newer covers).
While the memory used exceeds the budget, copies received from peers (`seal.is_peer_copy`) leave first, oldest
first, whatever their age (they are another host's redundancy, never this host's only copy); then further steps
leave under the same rule, oldest first. A step that may not leave stays: the trainer then sends its next save
straight to storage (`fits`), which makes the older steps superseded. A run or rank directory left empty goes too.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from pathlib import Path

import redis

from dcs_tasks.checkpoint.format.layout import RANK_DIR
from dcs_tasks.checkpoint.store.tiers.memdir import (
    MemoryStep,
    is_dir,
    memory_root,
    recycled_bytes,
    remove_step,
    scan,
    trim_pool,
    used_bytes,
)
from dcs_tasks.checkpoint.store.tiers.stepplaces import COPYING, FLUSHING, MARKS, Places, mem_place, peer_place
from dcs_tasks.config import DCSConfig
from dcs_tasks.keys import Keys

log = logging.getLogger(__name__)


def evictable(
    steps: Iterable[MemoryStep],
    places: dict[tuple[int, int], set[str]],
    this_host: str,
    keep_last: int,
    over_budget: int,
) -> list[MemoryStep]:
    """The steps that leave memory now (module docstring), oldest first. `steps`: one run's; `over_budget`: the
    bytes above the budget (<= 0: only the keep_last rule)."""
    mine = {mem_place(this_host), peer_place(this_host)}
    by_rank: dict[int, list[MemoryStep]] = {}
    for s in steps:
        if s.committed:
            by_rank.setdefault(s.rank, []).append(s)
    leaving: list[MemoryStep] = []
    spare: list[MemoryStep] = []
    for rank, held in by_rank.items():
        held.sort(key=lambda s: s.step)
        newest_safe = max(
            (s for (s, r), ps in places.items() if r == rank and (ps - mine - MARKS)),
            default=-1,
        )
        for index, s in enumerate(held[:-1]):  # never the newest complete one
            recorded = places.get((s.step, rank), set())
            if recorded & {FLUSHING, COPYING}:
                continue
            if not (recorded - mine - MARKS or newest_safe > s.step):
                continue
            (leaving if index < len(held) - keep_last else spare).append(s)
    freed = sum(s.nbytes for s in leaving)
    for s in sorted(spare, key=lambda s: s.step):
        if freed >= over_budget:
            break
        leaving.append(s)
        freed += s.nbytes
    return sorted(leaving, key=lambda s: (s.step, s.rank))


def evict(config: DCSConfig, client: redis.Redis, keys: Keys, run: str | None = None) -> list[MemoryStep]:
    """Apply the eviction rule to the memory root (one base run, or all); returns the steps removed. Redis
    unreachable: nothing leaves (whether a copy exists elsewhere is unknown)."""
    root = memory_root(config)
    held = scan(root, run)
    # room for one more step as big as the biggest held: else the next save would not fit and go to storage
    over = used_bytes(root) + max((s.nbytes for s in held), default=0) - config.memory.budget_bytes
    book = Places(client, keys)
    removed: list[MemoryStep] = []
    host = config.host_name
    copies = [s for s in (held if run is None else scan(root)) if s.peer and s.committed] if over > 0 else []
    for s in sorted(copies, key=lambda s: (s.step, s.run, s.rank)):
        if over <= 0:  # over budget: peer copies leave first, oldest first
            break
        with contextlib.suppress(redis.RedisError):
            book.forget(s.run, s.step, s.rank, peer_place(host))
        remove_step(s, root, config.memory.budget_bytes - used_bytes(root) - recycled_bytes(root))
        _prune(root, s.path)
        over -= s.nbytes
        removed.append(s)
        log.info("memory tier: peer copy %s left memory (%d bytes, over budget)", s.rel, s.nbytes)
    held = [s for s in held if s.path not in {r.path for r in removed}]
    for name in sorted({s.run for s in held}):
        try:
            places = book.read(name)
        except redis.RedisError as exc:
            log.warning("memory tier: places of run %r unreadable (%s): nothing leaves memory", name, exc)
            continue
        for s in evictable([s for s in held if s.run == name], places, host, config.memory.keep_last, over):
            with contextlib.suppress(redis.RedisError):
                book.forget(name, s.step, s.rank, mem_place(host), peer_place(host))
            # the pool keeps what the budget leaves free: with storage every N steps, about N steps leave at once
            # after each flush and the next N saves overwrite their pages (new tmpfs pages cost their zeroing)
            remove_step(s, root, config.memory.budget_bytes - used_bytes(root) - recycled_bytes(root))
            _prune(root, s.path)
            over -= s.nbytes
            removed.append(s)
            log.info("memory tier: step %d of %s rank %d left memory (%d bytes)", s.step, name, s.rank, s.nbytes)
    trim_pool(root, config.memory.budget_bytes - used_bytes(root))
    return removed


def _prune(root: Path, step_dir: Path) -> None:
    """Remove the rank directory, then the run directory, that held a step which left memory, when empty."""
    parent = step_dir.parent
    for directory in (parent, parent.parent) if RANK_DIR.fullmatch(parent.name) else (parent,):
        if directory == root or not directory.is_relative_to(root) or not is_dir(directory):
            return
        try:
            directory.rmdir()
        except OSError:
            return
