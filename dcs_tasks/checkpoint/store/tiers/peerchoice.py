"""The memory tier's peers (store stage: no torch): the peer servers registered in Redis, and which of them hold a
host's copies (`choose_peers`: other failure domains first, spread over hosts).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import redis

from dcs_tasks.celery_app import node_queue
from dcs_tasks.checkpoint.store.tiers.stepplaces import HOST_RE
from dcs_tasks.keys import Keys

PEER_FRESH_SECONDS = 15.0  # a peer server not re-registered for this long is not offered


@dataclass(frozen=True)
class Peer:
    host: str
    address: str
    port: int
    domain: str
    seen: float


def register_peer(client: redis.Redis, keys: Keys, peer: Peer) -> None:
    value = {"address": peer.address, "port": peer.port, "domain": peer.domain, "seen": peer.seen}
    client.hset(keys.memory_peers(), peer.host, json.dumps(value))


def unregister_peer(client: redis.Redis, keys: Keys, host: str) -> None:
    client.hdel(keys.memory_peers(), host)


def peers(
    client: redis.Redis, keys: Keys, fresh_seconds: float = PEER_FRESH_SECONDS, present: bool = True
) -> dict[str, Peer]:
    """The peer servers registered recently (malformed records skipped); with `present`, only those whose host's
    worker is present too (its presence key expires seconds after the worker dies; the server dies with it)."""
    found: dict[str, Peer] = {}
    now = time.time()
    raw = client.hgetall(keys.memory_peers())
    for host_b, value in list(raw.items())[:10_000]:
        try:
            host = host_b.decode() if isinstance(host_b, bytes) else str(host_b)
            record = json.loads(value)
            peer = Peer(host, str(record["address"]), int(record["port"]), str(record["domain"]), float(record["seen"]))
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            continue
        if HOST_RE.fullmatch(host) and 0 < peer.port < 65536 and len(peer.address) <= 255:
            if now - peer.seen <= fresh_seconds:
                found[host] = peer
    if present and found:
        pipe = client.pipeline(transaction=False)
        for host in found:
            pipe.exists(keys.worker_presence(node_queue(host)))
        found = {host: peer for (host, peer), alive in zip(found.items(), pipe.execute(), strict=True) if alive}
    return found


def choose_peers(own_host: str, own_domain: str, candidates: dict[str, Peer], count: int) -> list[Peer]:
    """`count` peers for `own_host`'s steps: hosts of domains other than `own_domain`, walking the ring of hosts
    (sorted by name) from the one after `own_host`, one host per domain first (so the copies spread over domains),
    then more hosts of the same other domains. Fewer when fewer qualify."""
    ring = sorted(candidates)
    start = next((i for i, h in enumerate(ring) if h > own_host), 0)
    ordered = [candidates[h] for h in ring[start:] + ring[:start] if h != own_host]
    eligible = [p for p in ordered if p.domain != own_domain]
    chosen: list[Peer] = []
    domains: set[str] = set()
    for peer in eligible:
        if peer.domain not in domains and len(chosen) < count:
            chosen.append(peer)
            domains.add(peer.domain)
    for peer in eligible:
        if peer not in chosen and len(chosen) < count:
            chosen.append(peer)
    return chosen
