"""The cluster topology, kept entirely in Redis (the coordinator holds no state of its own).

Layout (keys from `dcs_tasks.keys`): per role a hash rank -> RoleInfo JSON, a hash rank -> "ip:port"
identity and its inverse identity -> rank, and the nodes' last beats by rank (where a rank-less registration
looks for the role's dead ranks); a sorted set of roles in first-registration order; per node a heartbeat key
with a TTL of `heartbeat_timeout`. A node is alive iff its heartbeat key exists.
Registration, heartbeat and unregistration are single Lua scripts (see `coordinator.scripts`),
so concurrent coordinators agree.

Every method raises `redis.RedisError` subclasses when Redis is unreachable; the app maps them to 503.
A stored record that cannot be read (not JSON, not a RoleInfo, a key of the wrong type) is skipped and
listed in `TopologySnapshot.unreadable` (/health reports it), so one bad record never fails every read.
Nodes dead for longer than the retention are removed by `sweep_dead_nodes`, and a role with its last node.
"""

from __future__ import annotations

import enum
import logging
import re
import secrets
import time
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from coordinator import groups, scripts
from coordinator.limits import METADATA_DEPTH_CEILING, json_depth
from dcs_tasks.config import RoleInfo, TopologyConfig
from dcs_tasks.errors import RankConflict
from dcs_tasks.keys import Keys

log = logging.getLogger(__name__)


class RegistrationKind(str, enum.Enum):
    """How `register` chose the rank."""

    EXPLICIT = "explicit"
    REREGISTERED = "reregistered"
    ASSIGNED = "assigned"


_MAX_CACHED_NODES = 65536
_SWEEP_BATCH = 500
_NODE_REFRESH_SHARE = 10  # a batched beat rewrites node_beats once per this share of the dead-node retention
_REGISTER_CHUNK = 256  # nodes per REGISTER_MANY call (~5 ms of Redis): a 2,048-node batch does not hold it long
_BEAT_CODES = {"1": 1, "0": 0, "x": -1}
_KINDS = {0: RegistrationKind.EXPLICIT, 1: RegistrationKind.REREGISTERED, 2: RegistrationKind.ASSIGNED}


@dataclass(frozen=True)
class Registration:
    rank: int
    kind: RegistrationKind
    identity: str  # what the node sends as X-DCS-Node to fence its heartbeats


@dataclass(frozen=True)
class NodeRecord:
    info: RoleInfo
    alive: bool
    ttl_ms: int | None


@dataclass(frozen=True)
class TopologySnapshot:
    """Registered nodes (dead ones too) of the roles read, and the roles in global-rank order."""

    roles: list[str]
    nodes: dict[str, dict[int, NodeRecord]] = field(default_factory=dict)
    unreadable: list[str] = field(default_factory=list)  # "redis key[rank]" of records skipped

    def alive(self, role: str) -> dict[int, RoleInfo]:
        return {rank: rec.info for rank, rec in sorted(self.nodes.get(role, {}).items()) if rec.alive}

    def alive_by_role(self) -> dict[str, dict[int, RoleInfo]]:
        return {role: self.alive(role) for role in self.roles if role in self.nodes}

    def world_sizes(self) -> dict[str, int]:
        """Live nodes per role (invariant 4: dead nodes are not counted)."""
        return {role: len(self.alive(role)) for role in self.roles}

    def rank_spans(self) -> dict[str, int]:
        """Per role, the size of its block of global ranks (`groups.rank_span`: highest live rank + 1)."""
        return {role: groups.rank_span(self.alive(role)) for role in self.roles}

    def world_size(self, role: str | None = None) -> int:
        sizes = self.world_sizes()
        return sizes.get(role, 0) if role is not None else sum(sizes.values())

    def dead_node_ids(self) -> list[str]:
        return [rec.info.node_id for role in self.roles for rec in self.nodes.get(role, {}).values() if not rec.alive]


_ISSUED = re.compile(r"^anon:[0-9a-f]{16}$")


def _registration(info: RoleInfo, rank: int, kind: int, identity: str) -> Registration:
    """The answer of `scripts.REGISTER`; RankConflict (409) when it refused to take a live node's rank."""
    if kind < 0:
        raise RankConflict(
            f"{info.role_name}_{rank} is held by a live node of another identity: a register does not take it "
            "over (it is free once that node unregisters or its heartbeats stop for the heartbeat timeout)",
            409,
        )
    return Registration(rank=rank, kind=_KINDS[kind], identity=identity)


def node_identity(ip: str, port: int) -> str:
    """Stable identity of a node for re-registration and heartbeat fencing; "" without a port (indistinct)."""
    return f"{ip}:{port}" if port else ""


def issued_identity() -> str:
    """A fencing identity for a node without a port: unique per registration, so it never reclaims a rank."""
    return "anon:" + secrets.token_hex(8)


def is_issued_identity(text: str) -> bool:
    return _ISSUED.match(text) is not None


class TopologyManager:
    """Register, beat, look up and export nodes. One instance per coordinator process; all state in Redis.

    Rank policy (atomic, in `scripts.REGISTER`): an explicit rank is honoured (a previous holder is
    replaced); a node re-registering from the same ip:port keeps its rank; otherwise it gets the smallest
    rank that is unregistered or whose node is dead, so a replacement fills a dead node's slot. A node that
    comes back after being replaced is refused by fenced heartbeats (`RankConflict`) instead of sharing it.

    Fencing identity: "ip:port" for a node with a port; a node without one (port 0) gets a fresh issued
    identity per registration (`issued_identity`). `register` returns it; a heartbeat that carries it is
    fenced, one that carries none is not (e.g. curl).
    """

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        config: TopologyConfig,
        heartbeat_timeout_seconds: float,
        *,
        identity_required: bool = False,
        unbeaten_retention_seconds: float | None = None,
        heartbeat_interval_seconds: float | None = None,
        dead_node_retention_seconds: float | None = None,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.config = config
        self.heartbeat_timeout_seconds = heartbeat_timeout_seconds
        self.identity_required = identity_required  # a register may not take a live node's rank over
        self.unbeaten_retention_seconds = unbeaten_retention_seconds
        self._ttl_ms = max(1, int(heartbeat_timeout_seconds * 1000))
        self._ttl_arg = str(self._ttl_ms)
        self._beat_keys: dict[tuple[str, int], tuple[list[str], str]] = {}
        # a batched beat rewrites each of the node's last-beat records when it falls in another period of that
        # record's length than the heartbeat key's value, the node's last beat that rewrote one
        # (scripts.HEARTBEAT_MANY): once per period; 0 (no interval given): every beat. The role's record (rank
        # assignment's) is scored half the TTL after the beat and taken as maybe dead once older than half the
        # TTL: rewritten every TTL less 1.5 intervals, it never is while the node beats every interval (or up to
        # 1.5 intervals apart). node_beats (the dead-node sweep's) lags the last beat by under its period, how
        # much sooner than its retention a dead node may be swept: its period is a tenth of the
        # retention (the role's when none is given); the sweep puts a live node it finds behind back, so no
        # period is a risk to a live node.
        role_refresh = (
            0.0
            if heartbeat_interval_seconds is None
            else max(0.0, heartbeat_timeout_seconds - 1.5 * heartbeat_interval_seconds)
        )
        node_refresh = (
            role_refresh
            if dead_node_retention_seconds is None or heartbeat_interval_seconds is None
            else dead_node_retention_seconds / _NODE_REFRESH_SHARE
        )
        self._beat_many_keys = [keys.node_beats(), keys.node_unbeaten()]
        self._beat_many_argv = [  # ARGV[3..6] of scripts.HEARTBEAT_MANY
            keys.role_nodes_prefix(),
            keys.role_owners_prefix(),
            keys.heartbeat_prefix(),
            repr(role_refresh),
        ]
        self._beat_many_tail = [keys.role_beats_prefix(), keys.role_stale_prefix(), repr(node_refresh)]  # ARGV[8..10]
        self._register_many_keys = [keys.roles(), keys.role_seq(), keys.node_beats(), keys.node_unbeaten()]
        self._register_prefixes = [  # ARGV[4..10] of scripts.REGISTER_MANY
            keys.role_nodes_prefix(),
            keys.role_owners_prefix(),
            keys.role_identities_prefix(),
            keys.role_rank_hint_prefix(),
            keys.heartbeat_prefix(),
            keys.role_beats_prefix(),
            keys.role_stale_prefix(),
        ]
        self._prune_from = 0  # where the next role prune continues (a hint: any value is correct)

    # --- writes ---------------------------------------------------------------------------------
    async def register(self, info: RoleInfo) -> Registration:
        """Store `info`, choose its rank (explicit, kept, or smallest free) and make it alive, atomically."""
        keys, argv, identity = self._register_call(info)
        rank, kind = await scripts.REGISTER.run_async(self.redis, keys, argv)
        return _registration(info, int(rank), int(kind), identity)

    async def register_many(self, infos: list[RoleInfo]) -> list[Registration]:
        """`register` for each of `infos`, in order (each sees the ones before it), in one round trip:
        `scripts.REGISTER_MANY` per `_REGISTER_CHUNK` nodes, so Redis is never held long by one call."""
        identities = [node_identity(info.ip, info.port) or issued_identity() for info in infos]
        head = [self._ttl_arg, repr(time.time()), "1" if self.identity_required else "", *self._register_prefixes]
        async with self.redis.pipeline(transaction=False) as pipe:
            for start in range(0, len(infos), _REGISTER_CHUNK):
                argv = list(head)
                for info, identity in zip(infos[start : start + _REGISTER_CHUNK], identities[start:], strict=False):
                    rank = "" if info.rank is None else str(info.rank)
                    argv += (info.role_name, rank, identity, info.model_dump_json(exclude={"rank"}))
                await scripts.REGISTER_MANY.run_async(pipe, self._register_many_keys, argv)
            answers = await pipe.execute()
        flat = [int(x) for answer in answers for x in answer]
        return [
            _registration(info, flat[2 * i], flat[2 * i + 1], identity)
            for i, (info, identity) in enumerate(zip(infos, identities, strict=True))
        ]

    def _register_call(self, info: RoleInfo) -> tuple[list[str], list[str], str]:
        """KEYS, ARGV of `scripts.REGISTER` for `info`, and the node's fencing identity."""
        role = info.role_name
        identity = node_identity(info.ip, info.port) or issued_identity()
        keys = [
            self.keys.role_nodes(role),
            self.keys.role_owners(role),
            self.keys.roles(),
            self.keys.role_seq(),
            self.keys.node_beats(),
            self.keys.role_identities(role),
            self.keys.role_rank_hint(role),
            self.keys.node_unbeaten(),
            self.keys.role_beats(role),
            self.keys.role_stale(role),
        ]
        argv = [
            role,
            "" if info.rank is None else str(info.rank),
            identity,
            info.model_dump_json(exclude={"rank"}),
            str(self._ttl_ms),
            self.keys.heartbeat_role_prefix(role),
            repr(time.time()),
            "1" if self.identity_required else "",
        ]
        return keys, argv, identity

    async def heartbeat(self, role: str, rank: int, identity: str = "") -> float | None:
        """Refresh the node's TTL; returns the beat time, or None when (role, rank) is not registered.

        With an `identity` (as `register` returned it), raises RankConflict when another node now holds the
        rank; with "" the beat is not fenced.
        """
        now = time.time()
        keys, member = self._heartbeat_keys(role, rank)
        found = int(
            await scripts.HEARTBEAT.run_async(self.redis, keys, [str(rank), self._ttl_arg, repr(now), identity, member])
        )
        if found < 0:
            raise RankConflict(f"{role}_{rank} is now held by another node; {identity} was presumed dead", 409)
        return now if found else None

    async def heartbeat_many(self, beats: list[tuple[str, int, str]]) -> tuple[float, list[int]]:
        """Beat every (role, rank, identity) in one Lua call; returns the beat time and one code per beat:
        1 recorded, 0 not registered, -1 fenced out (another node holds the rank; identity "" = unfenced)."""
        now, codes = await self.heartbeat_many_packed("\n".join(f"{r}\n{k}\n{i}" for r, k, i in beats))
        return now, [_BEAT_CODES[c] for c in codes]

    async def heartbeat_many_packed(self, packed: str) -> tuple[float, str]:
        """`heartbeat_many` for beats already packed as `scripts.HEARTBEAT_MANY` takes them ("role\nrank\nidentity"
        joined by "\n", every part checked: no "\n" inside); returns the beat time and one character per beat
        ("1" recorded, "0" not registered, "x" fenced out)."""
        now = time.time()
        argv = [self._ttl_arg, repr(now), *self._beat_many_argv, packed, *self._beat_many_tail]
        codes = await scripts.HEARTBEAT_MANY.run_async(self.redis, self._beat_many_keys, argv)
        return now, codes.decode() if isinstance(codes, bytes) else str(codes)

    def _heartbeat_keys(self, role: str, rank: int) -> tuple[list[str], str]:
        """The heartbeat script's KEYS and node_beats member, memoised: heartbeats are the hot path (bounded;
        cleared when large)."""
        found = self._beat_keys.get((role, rank))
        if found is None:
            if len(self._beat_keys) >= _MAX_CACHED_NODES:
                self._beat_keys.clear()
            keys = [
                self.keys.role_nodes(role),
                self.keys.heartbeat(role, rank),
                self.keys.role_owners(role),
                self.keys.node_beats(),
                self.keys.node_unbeaten(),
                self.keys.role_beats(role),
                self.keys.role_stale(role),
            ]
            found = (keys, f"{role}:{rank}")
            self._beat_keys[(role, rank)] = found
        return found

    async def unregister(self, role: str, rank: int, identity: str = "") -> bool:
        """Remove the node; False when it was not registered.

        With an `identity`, raises RankConflict (and removes nothing) when another node now holds the rank.
        """
        keys = [
            self.keys.role_nodes(role),
            self.keys.role_owners(role),
            self.keys.heartbeat(role, rank),
            self.keys.roles(),
            self.keys.node_beats(),
            self.keys.role_identities(role),
            self.keys.role_rank_hint(role),
            self.keys.node_unbeaten(),
            self.keys.role_beats(role),
            self.keys.role_stale(role),
        ]
        found = int(await scripts.UNREGISTER.run_async(self.redis, keys, [str(rank), identity, role]))
        if found < 0:
            raise RankConflict(f"{role}_{rank} is now held by another node; {identity} may not remove it", 409)
        return bool(found)

    async def sweep_dead_nodes(self, retention_seconds: float, now: float | None = None) -> int:
        """Remove every node whose last beat is older than its heartbeat timeout plus `retention_seconds`,
        and each role with its last node; returns how many stale entries were processed."""
        now = time.time() if now is None else now
        cutoff = now - self.heartbeat_timeout_seconds - retention_seconds
        unbeaten = self.unbeaten_retention_seconds
        unbeaten_cutoff = "-inf" if unbeaten is None else repr(now - self.heartbeat_timeout_seconds - unbeaten)
        keys = [self.keys.node_beats(), self.keys.roles(), self.keys.node_unbeaten()]
        prefixes = [
            self.keys.role_nodes_prefix(),
            self.keys.role_owners_prefix(),
            self.keys.heartbeat_prefix(),
            self.keys.role_identities_prefix(),
            self.keys.role_rank_hint_prefix(),
        ]
        tail = [self.keys.role_beats_prefix(), self.keys.role_stale_prefix()]  # ARGV[10..11]
        total = 0
        while True:
            done = int(
                await scripts.SWEEP_DEAD_NODES.run_async(
                    self.redis, keys, [repr(cutoff), _SWEEP_BATCH, *prefixes, unbeaten_cutoff, repr(now), *tail]
                )
            )
            total += done
            if done < _SWEEP_BATCH:
                break
        await self.prune_empty_roles()
        return total

    async def prune_empty_roles(self) -> int:
        """Drop up to one batch of roles that have no node record from the role order; returns how many."""
        args: list[str | int] = [self._prune_from, _SWEEP_BATCH, self.keys.role_nodes_prefix()]
        nxt, removed = await scripts.PRUNE_EMPTY_ROLES.run_async(self.redis, [self.keys.roles()], args)
        self._prune_from = int(nxt)
        return int(removed)

    # --- reads ----------------------------------------------------------------------------------
    async def registered_roles(self) -> list[str]:
        return [str(r) for r in await self.redis.zrange(self.keys.roles(), 0, -1)]

    async def snapshot(self, roles: list[str] | None = None, *, alive_only: bool = False) -> TopologySnapshot:
        """Nodes of `roles` (default: every role) with liveness, read in one atomic script; `alive_only`:
        dead nodes are neither read nor parsed (reads of the live topology do not slow with dead entries)."""
        order = groups.role_order(self.config.role_order, await self.registered_roles())
        wanted = order if roles is None else [r for r in order if r in roles] or list(roles)
        if not wanted:
            return TopologySnapshot(roles=order)
        keys = [self.keys.role_nodes(r) for r in wanted]
        argv = [self.keys.heartbeat_role_prefix(r) for r in wanted] + ["1" if alive_only else ""]
        raw = await scripts.SNAPSHOT.run_async(self.redis, keys, argv)
        snap = TopologySnapshot(roles=order)
        for role, key, flat in zip(wanted, keys, raw, strict=True):
            if len(flat) % 3:  # {"!<type>"}: the key is not a hash
                snap.unreadable.append(f"{key} (a {str(flat[0])[1:]}, not a hash)")
                continue
            records: dict[int, NodeRecord] = {}
            for i in range(0, len(flat), 3):
                info = self._parse(role, str(flat[i]), flat[i + 1])
                if info is None:
                    snap.unreadable.append(f"{key}[{flat[i]}]")
                    continue
                ttl = int(flat[i + 2])
                records[info.rank or 0] = NodeRecord(info=info, alive=ttl != -2, ttl_ms=None if ttl == -2 else ttl)
            snap.nodes[role] = records
        return snap

    @staticmethod
    def _parse(role: str, rank: str, raw: str) -> RoleInfo | None:
        """The stored record of (role, rank), or None (logged) when it is not a valid RoleInfo of that node."""
        try:
            info = RoleInfo.model_validate_json(raw)
            if info.role_name != role or str(info.rank) != rank:
                raise ValueError(f"it says it is {info.role_name}_{info.rank}")
            if json_depth(info.metadata) > METADATA_DEPTH_CEILING:  # no answer holding it would parse
                raise ValueError(f"its metadata is nested deeper than {METADATA_DEPTH_CEILING}")
        except ValueError as exc:  # pydantic's ValidationError is a ValueError
            log.warning("skipping the unreadable topology record %s_%s: %s", role, rank[:64], str(exc)[:300])
            return None
        return info

    async def get_node(self, role: str, rank: int, *, include_dead: bool = False) -> RoleInfo | None:
        """The node at (role, rank), or None when unregistered (or dead, unless `include_dead`)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hget(self.keys.role_nodes(role), str(rank))
            pipe.exists(self.keys.heartbeat(role, rank))
            raw, alive = await pipe.execute()
        if raw is None or not (alive or include_dead):
            return None
        return self._parse(role, str(rank), raw)

    def peer_role_of(self, role: str, peer_role: str | None = None) -> str | None:
        """`peer_role` if given, else the configured mapping of `role` (None: no mapping)."""
        return peer_role or self.config.get_peer_role(role)

    async def get_peer(self, role: str, rank: int, peer_role: str | None = None) -> RoleInfo | None:
        """The live node of the same rank in `peer_role` (default: the configured mapping of `role`)."""
        target = self.peer_role_of(role, peer_role)
        if target is None:
            return None
        return await self.get_node(target, rank)

    async def get_all_peers(self, role: str, rank: int) -> dict[str, RoleInfo]:
        """Live nodes of the same rank in every role `role` maps to or is mapped from."""
        related = {v for k, v in self.config.role_mappings.items() if k == role}
        related |= {k for k, v in self.config.role_mappings.items() if v == role}
        peers = {r: await self.get_node(r, rank) for r in sorted(related)}
        return {r: node for r, node in peers.items() if node is not None}

    async def get_role_nodes(self, role: str) -> dict[int, RoleInfo]:
        return (await self.snapshot([role], alive_only=True)).alive(role)

    async def get_all_nodes(self) -> dict[str, dict[int, RoleInfo]]:
        return (await self.snapshot(alive_only=True)).alive_by_role()

    async def get_world_size(self, role: str | None = None) -> int:
        """Number of live nodes of `role`, or of every role."""
        return (await self.snapshot(None if role is None else [role], alive_only=True)).world_size(role)

    async def get_global_rank(self, role: str, rank: int) -> int | None:
        """Global rank of a live node (see `groups.global_rank`: rank spans of the earlier roles + rank), or
        None when it is not alive."""
        snap = await self.snapshot(alive_only=True)
        if rank not in snap.alive(role):
            return None
        return groups.global_rank(snap.roles, snap.rank_spans(), role, rank)

    async def check_health(self) -> TopologySnapshot:
        """The full snapshot; its `dead_node_ids()` are the nodes registered without a heartbeat key."""
        return await self.snapshot()

    async def to_dict(self) -> dict[str, object]:
        """Every registered node with liveness, as plain JSON-able data (for debugging)."""
        snap = await self.snapshot()
        return {
            "roles": snap.roles,
            "nodes": {
                role: {
                    rank: {"info": rec.info.model_dump(mode="json"), "alive": rec.alive} for rank, rec in recs.items()
                }
                for role, recs in snap.nodes.items()
            },
        }
