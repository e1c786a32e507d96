"""Whose memory-tier step is whose, in Redis (store stage: no torch): what lets a peer server accept a copy and a
restore trust a pulled one.

Whose step is whose (`Owners`, `Keys.step_owners`): when a memory step commits, the worker of its host records
itself as the step's owner with the SHA-256 of the step's manifest. A peer server accepts a copy (`PutCheck`)
only of a step whose owner is another host and whose manifest is the one recorded, byte for byte, so the shared
token alone no longer lets a peer place a step of a run and rank it does not hold, nor one of this host's own
(a restore here therefore never finds a peer's bytes where its own committed step belongs); the manifest carries
every file's checksum, which the receiver checks on arrival. The proof is the owner's write to Redis, which the
token does not grant. Pulls check the same record when there is one. A put must also fit (`room`: the budget
less what the tier holds; the peer server reserves a put's manifest, files and seal before any byte lands).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable

import redis

from dcs_tasks.checkpoint.store.peers.stepfiles import StepRel
from dcs_tasks.checkpoint.store.tiers.stepplaces import HOST_RE, KEPT_STEPS_IN_PLACES
from dcs_tasks.errors import PeerCorrupt, PeerRefused
from dcs_tasks.keys import Keys


def manifest_digest(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


class Owners:
    """Which host committed each memory step, and the digest of its manifest (module docstring). Every method
    may raise redis.RedisError."""

    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self._redis = client
        self._keys = keys

    def record(self, run: str, step: int, rank: int, host: str, manifest: bytes) -> None:
        key = self._keys.step_owners(run)
        value = json.dumps({"host": host, "digest": manifest_digest(manifest)})
        pipe = self._redis.pipeline(transaction=False)
        pipe.hset(key, f"{step}|{rank}", value)
        pipe.hlen(key)
        _, size = pipe.execute()
        if int(size) > KEPT_STEPS_IN_PLACES * 4:  # the oldest steps' records go, as their places do
            fields = [f.decode() if isinstance(f, bytes) else str(f) for f in self._redis.hkeys(key)]
            steps = sorted({int(f.split("|")[0]) for f in fields if f.split("|")[0].isdigit()}, reverse=True)
            old = set(steps[KEPT_STEPS_IN_PLACES:])
            drop = [f for f in fields if not f.split("|")[0].isdigit() or int(f.split("|")[0]) in old]
            if drop:
                self._redis.hdel(key, *drop)

    def get(self, run: str, step: int, rank: int) -> tuple[str, str] | None:
        """(host, manifest digest) of the step's owner; None when none is recorded (or the record is malformed)."""
        raw = self._redis.hget(self._keys.step_owners(run), f"{step}|{rank}")
        if raw is None or len(raw) > 1024:
            return None
        try:
            record = json.loads(raw)
            host, digest = str(record["host"]), str(record["digest"])
        except (ValueError, KeyError, TypeError):
            return None
        return (host, digest) if HOST_RE.fullmatch(host) else None


class PutCheck:
    """`transfer.PeerServer.accept_put` for the memory tier of `this_host`: a peer may put only a step that another
    host recorded as its own, with that manifest (module docstring); PeerRefused otherwise."""

    def __init__(self, client: redis.Redis, keys: Keys, this_host: str) -> None:
        self._owners = Owners(client, keys)
        self.this_host = this_host

    def __call__(self, rel: StepRel, raw: bytes) -> None:
        try:
            owner = self._owners.get(rel.run, rel.step, rel.rank or 0)
        except redis.RedisError as exc:
            raise PeerRefused(f"cannot check whose step {rel} is (Redis: {exc}); try again") from exc
        if owner is None:
            raise PeerRefused(f"{rel}: no host recorded committing it; a peer may copy only another host's step")
        if owner[0] == self.this_host:
            raise PeerRefused(f"{rel} is this host's own step: a peer may not place a copy of it here")
        if manifest_digest(raw) != owner[1]:
            raise PeerRefused(f"{rel}: its manifest is not the one host {owner[0]} committed")


def pull_check(client: redis.Redis, keys: Keys) -> Callable[[StepRel, bytes], None]:
    """`transfer.pull_step`'s `accept` for a restore: a step whose owner is recorded must come with the manifest
    recorded (PeerCorrupt otherwise); one without a record (lost with Redis's data) is taken on its checksums."""
    owners = Owners(client, keys)

    def check(rel: StepRel, raw: bytes) -> None:
        try:
            owner = owners.get(rel.run, rel.step, rel.rank or 0)
        except redis.RedisError:
            owner = None
        if owner is not None and manifest_digest(raw) != owner[1]:
            raise PeerCorrupt(f"{rel}: the peer's manifest is not the one host {owner[0]} committed")

    return check
