"""Restore from peers (store stage: no torch): the parts of a run's newest steps that live peers hold in memory and
this host does not, fetched into this host's memory tier (`transfer.pull_step`: verified on arrival, installed
atomically).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import redis

from dcs_tasks.checkpoint.store.peers import transfer
from dcs_tasks.checkpoint.store.peers.stepfiles import StepRel
from dcs_tasks.checkpoint.store.tiers.memdir import memory_root, scan
from dcs_tasks.checkpoint.store.tiers.owners import pull_check
from dcs_tasks.checkpoint.store.tiers.peerchoice import Peer, peers
from dcs_tasks.checkpoint.store.tiers.stepplaces import Places, rel_step
from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import CheckpointError
from dcs_tasks.keys import Keys

log = logging.getLogger(__name__)


def _holders(places: dict[tuple[int, int], set[str]], me: str, live: dict[str, Peer]) -> dict[int, set[str]]:
    """step -> the live peer hosts (not `me`) whose memory holds a part of it."""
    holders: dict[int, set[str]] = {}
    for (s, _), where in places.items():
        for place in where:
            host = place.partition("@")[2]
            if host and host != me and host in live:
                holders.setdefault(s, set()).add(host)
    return holders


def pull_from_peers(
    config: DCSConfig, client: redis.Redis, keys: Keys, run: str, step: int | None, newest: int = 4
) -> dict[int, str]:
    """Fetch into this host's memory the parts of run `run`'s newest steps (of the `newest` newest that peers hold,
    newest first, stopping at the first one something was fetched for; or of `step`) that live peers hold in memory
    and this host does not (`transfer.pull_step`: verified on arrival, installed atomically). Returns step -> the
    peer a part came from. A peer that fails is skipped with a warning (the restore uses what it finds)."""
    token = config.token()
    if not token:
        return {}
    places = Places(client, keys).read(run)
    live = peers(client, keys)
    holders = _holders(places, config.host_name, live)
    root = memory_root(config, create=True)
    local = {(m.step, m.rank) for m in scan(root, run) if m.committed}
    listed: dict[str, list[str]] = {}
    pulled: dict[int, str] = {}
    check = pull_check(client, keys)
    for s in [step] if step is not None else sorted(holders, reverse=True)[:newest]:
        for host in sorted(holders.get(s, ())):
            address = (live[host].address, live[host].port)
            if host not in listed:
                listed[host] = _list(address, token, run, host, config)
            for rel in listed[host]:
                found = rel_step(rel)
                if found is None or found[1] != s or (s, found[0]) in local:
                    continue
                if _pull(address, token, rel, root, config, host, check):
                    local.add((s, found[0]))
                    pulled[s] = host
        if step is None and s in pulled:
            break
    return pulled


def _list(address: tuple[str, int], token: str, run: str, host: str, config: DCSConfig) -> list[str]:
    try:
        return transfer.list_steps(address, token, run, timeout=min(10.0, config.peer.timeout_seconds))
    except CheckpointError as exc:
        log.warning("memory tier: peer %s cannot list run %r: %s", host, run, exc)
        return []


def _pull(
    address: tuple[str, int],
    token: str,
    rel: str,
    root: Path,
    config: DCSConfig,
    host: str,
    check: Callable[[StepRel, bytes], None],
) -> bool:
    try:
        transfer.pull_step(
            address,
            token,
            rel,
            root,
            timeout=config.peer.timeout_seconds,
            max_bytes=max(config.memory.budget_bytes, 1),
            accept=check,
            min_rate=config.peer.min_bytes_per_second,
            rate_window=config.peer.rate_window_seconds,
            max_manifest_bytes=config.peer.max_manifest_bytes,
        )
    except CheckpointError as exc:
        log.warning("memory tier: could not fetch %s from peer %s: %s", rel, host, exc)
        return False
    log.info("memory tier: fetched %s from peer %s", rel, host)
    return True
