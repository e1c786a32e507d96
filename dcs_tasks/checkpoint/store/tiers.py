"""The memory tier's bookkeeping (store stage: no torch): where it lives, where each step lives, which peers hold
copies, and which steps may leave memory.

A memory-tier step is a committed step like any other (same files, same manifest, manifest last), written under
`memory_dir` (tmpfs) instead of `checkpoint_dir`, at the same relative path (`<run>/step-N`, a rank's part at
`<run>/rank-0000r/step-N`). Restore therefore reads it with every restore path (plain, `sharding=`, DTensor,
`strict=False`). tmpfs files outlive the trainer's and the worker's processes: a restarted worker finds its
host's memory steps by scanning `memory_dir`; a restarted host has lost them (peer copies and storage remain).

Where a step lives is recorded in Redis (`Keys.step_places`, one hash per base run, one field per place so that
workers never race on a read-modify-write): `mem@<host>` (committed in the memory of the rank's host),
`peer@<host>` (a peer copy, verified on arrival), `replicated` (every peer copy the placement asked for verified),
`storage` (copied to `checkpoint_dir` and verified there); and two marks, `flushing` and `copying`, while a flush
or a peer copy of the step is under way (recorded when it is sent, dropped when it ends). A place is recorded
only after the bytes are verified at it and dropped before they are deleted from it, so the hash may lag (a place
recorded late), never lie in the unsafe direction for long: eviction reads it to decide whether another copy
exists.

Eviction (`evictable`): per run and rank directory in memory, the newest complete step never leaves, nor a step
being flushed or copied (a flush that failed for good leaves its mark: the step stays, safe but held); the
`memory_keep_last` newest stay; an older step leaves once a copy of it, or of a newer step of the same rank,
exists in storage or in a peer's memory (then losing it loses no recovery point that nothing newer covers).
While the memory used exceeds the budget, copies received from peers (`seal.is_peer_copy`) leave first, oldest
first, whatever their age (they are another host's redundancy, never this host's only copy); then further steps
leave under the same rule, oldest first. A step that may not leave stays: the trainer then sends its next save
straight to storage (`fits`), which makes the older steps superseded. A run or rank directory left empty goes too.

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

import contextlib
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import stat
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import redis

from dcs_tasks import hostdirs
from dcs_tasks.celery_app import node_queue
from dcs_tasks.checkpoint.format.fsio import try_lock
from dcs_tasks.checkpoint.format.layout import MANIFEST_NAME, RANK_DIR, STEP_DIR
from dcs_tasks.checkpoint.store.peers import transfer
from dcs_tasks.checkpoint.store.peers.stepfiles import StepRel
from dcs_tasks.checkpoint.store.seal import SEAL_NAME, is_peer_copy
from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import CheckpointError, PeerCorrupt, PeerRefused
from dcs_tasks.keys import Keys

log = logging.getLogger(__name__)

MEMORY, STORAGE, REPLICATED = "memory", "storage", "replicated"
FLUSHING, COPYING = "flushing", "copying"  # a flush / peer copy of the step is under way: it may not leave memory
MARKS = {REPLICATED, FLUSHING, COPYING}  # fields that are not places
MEM_PREFIX, PEER_PREFIX = "mem@", "peer@"
MAX_PLACE_FIELDS = 100_000  # a hash bigger than this is not read (a hostile or runaway record)
KEPT_STEPS_IN_PLACES = 256  # the places of a run's older steps are dropped from the hash
PEER_FRESH_SECONDS = 15.0  # a peer server not re-registered for this long is not offered
RECYCLE_DIR = ".recycle"  # files of steps that left memory, overwritten by the next steps (`take_recycled`)
RECYCLE_MAX_FILES = 256  # files the recycle pool holds at most (its bytes: what the budget leaves free)
_HOST_RE = re.compile(r"^[A-Za-z0-9._:-]{1,255}$")


def enabled(config: DCSConfig) -> bool:
    return config.memory_tier_bytes > 0


def memory_root(config: DCSConfig, create: bool = False) -> Path:
    """The memory tier's directory, resolved (created 0700 when `create`); one that exists is checked private to
    this uid first (`dcs_tasks.hostdirs`: UnsafeHostDirectory for another user's directory, a link, mode 0777)."""
    return hostdirs.memory_dir(config, create=create).resolve()


def base_and_rank(run: str) -> tuple[str, int]:
    """(base run, rank) of a ledger run name: `<base>.rank-0000r` -> (base, r); a plain run is rank 0."""
    base, dot, suffix = run.rpartition(".")
    found = RANK_DIR.fullmatch(suffix) if dot and base else None
    return (base, int(found.group(1))) if found else (run, 0)


def rel_step(rel: str) -> tuple[int, int] | None:
    """(rank, step) of a step directory's path relative to the memory root (`<run>/step-N`, `<run>/rank-R/step-N`)."""
    parts = rel.split("/")
    step = STEP_DIR.fullmatch(parts[-1]) if parts else None
    if step is None or len(parts) not in (2, 3):
        return None
    if len(parts) == 2:
        return 0, int(step.group(1))
    rank = RANK_DIR.fullmatch(parts[1])
    return (int(rank.group(1)), int(step.group(1))) if rank else None


def mem_place(host: str) -> str:
    return MEM_PREFIX + host


def peer_place(host: str) -> str:
    return PEER_PREFIX + host


# --- places ------------------------------------------------------------------------------------------------
class Places:
    """Where the steps of runs live (module docstring). Every method may raise redis.RedisError."""

    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self._redis = client
        self._keys = keys

    def record(self, run: str, step: int, rank: int, *places: str) -> None:
        key = self._keys.step_places(run)
        now = f"{time.time():.3f}"
        pipe = self._redis.pipeline(transaction=False)
        pipe.hset(key, mapping={f"{step}|{rank}|{p}": now for p in places})
        pipe.hlen(key)
        _, size = pipe.execute()
        if int(size) > KEPT_STEPS_IN_PLACES * 8:
            self._trim(run)

    def forget(self, run: str, step: int, rank: int, *places: str) -> None:
        self._redis.hdel(self._keys.step_places(run), *(f"{step}|{rank}|{p}" for p in places))

    def read(self, run: str) -> dict[tuple[int, int], set[str]]:
        """(step, rank) -> places. Malformed fields are skipped (the hash is Redis data: untrusted)."""
        key = self._keys.step_places(run)
        if int(self._redis.hlen(key)) > MAX_PLACE_FIELDS:
            log.warning("places of run %r hold more than %d fields: not read", run, MAX_PLACE_FIELDS)
            return {}
        found: dict[tuple[int, int], set[str]] = {}
        for raw in self._redis.hkeys(key):
            parsed = _parse_field(raw)
            if parsed is not None:
                step, rank, place = parsed
                found.setdefault((step, rank), set()).add(place)
        return found

    def _trim(self, run: str) -> None:
        found = self.read(run)
        steps = sorted({s for s, _ in found}, reverse=True)[KEPT_STEPS_IN_PLACES:]
        if steps:
            old = [f"{s}|{r}|{p}" for (s, r), ps in found.items() if s in set(steps) for p in ps]
            self._redis.hdel(self._keys.step_places(run), *old)


def _parse_field(raw: bytes | str) -> tuple[int, int, str] | None:
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    parts = text.split("|")
    if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit() or len(parts[0]) > 18:
        return None
    place = parts[2]
    if place != STORAGE and place not in MARKS:
        host = place.removeprefix(MEM_PREFIX).removeprefix(PEER_PREFIX)
        if host == place or not _HOST_RE.fullmatch(host):
            return None
    return int(parts[0]), int(parts[1]), place


# --- owners ------------------------------------------------------------------------------------------------
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
        return (host, digest) if _HOST_RE.fullmatch(host) else None


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


# --- peers -------------------------------------------------------------------------------------------------
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
        if _HOST_RE.fullmatch(host) and 0 < peer.port < 65536 and len(peer.address) <= 255:
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


# --- what memory holds ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class MemoryStep:
    run: str  # base run
    rank: int
    step: int
    path: Path
    committed: bool
    nbytes: int
    peer: bool = False  # a copy received from another host (`seal.is_peer_copy`)

    @property
    def rel(self) -> str:
        return self.path.as_posix()


def _is_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(path.lstat().st_mode)
    except OSError:
        return False


def _children(path: Path) -> Iterator[os.DirEntry[str]]:
    with contextlib.suppress(OSError), os.scandir(path) as entries:
        yield from entries


def _dir_bytes(path: Path) -> int:
    total = 0
    for entry in _children(path):
        with contextlib.suppress(OSError):
            if entry.is_file(follow_symlinks=False):
                total += entry.stat(follow_symlinks=False).st_blocks * 512
    return total


def scan(root: Path, run: str | None = None) -> list[MemoryStep]:
    """The step directories under the memory root (`run`: only that base run's), symlinks ignored."""
    found: list[MemoryStep] = []
    runs = [root / run] if run is not None else [Path(e.path) for e in _children(root) if not e.name.startswith(".")]
    for run_dir in runs:
        if not _is_dir(run_dir):
            continue
        rank_dirs: list[tuple[int, Path]] = [(0, run_dir)]
        for entry in _children(run_dir):
            found_rank = RANK_DIR.fullmatch(entry.name)
            if found_rank and _is_dir(Path(entry.path)):
                rank_dirs.append((int(found_rank.group(1)), Path(entry.path)))
        for rank, rank_dir in rank_dirs:
            for entry in _children(rank_dir):
                matched = STEP_DIR.fullmatch(entry.name)
                path = Path(entry.path)
                if matched and _is_dir(path):
                    found.append(
                        MemoryStep(
                            run=run_dir.name,
                            rank=rank,
                            step=int(matched.group(1)),
                            path=path,
                            committed=os.path.isfile(path / MANIFEST_NAME),
                            nbytes=_dir_bytes(path),
                            peer=is_peer_copy(path),
                        )
                    )
    return found


def used_bytes(root: Path) -> int:
    """Bytes the memory root holds (steps, peer copies and partial ones), the recycle pool aside (its pages are
    the next steps')."""
    total = 0
    for step in scan(root):
        total += step.nbytes
    for entry in _children(root):  # incoming peer copies not yet installed
        if entry.name.startswith(".") and entry.name != RECYCLE_DIR and _is_dir(Path(entry.path)):
            total += sum(_dir_bytes(Path(p)) for p, _, _ in os.walk(entry.path))
    return total


def room(config: DCSConfig) -> int:
    """Bytes the memory tier may still take (the budget less what it holds; what a peer may put)."""
    return config.memory_tier_bytes - used_bytes(memory_root(config))


def fits(config: DCSConfig, nbytes: int) -> bool:
    """Whether a step of `nbytes` fits in the memory budget now (else the trainer sends it to storage)."""
    return used_bytes(memory_root(config)) + nbytes <= config.memory_tier_bytes


# --- eviction ----------------------------------------------------------------------------------------------
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


def remove_step(step: MemoryStep, root: Path | None = None, room: int = 0) -> None:
    """Delete a memory step: its manifest first (it stops being committed), then the rest. With `root`, up to
    `room` bytes of its files go to the recycle pool instead (`take_recycled`)."""
    with contextlib.suppress(FileNotFoundError):
        (step.path / MANIFEST_NAME).unlink()
    if root is not None and room > 0:
        pool = root / RECYCLE_DIR
        with contextlib.suppress(OSError):
            pool.mkdir(mode=0o700, exist_ok=True)
            kept = len(os.listdir(pool))
            for entry in _children(step.path):
                info = entry.stat(follow_symlinks=False)
                skip = entry.name == SEAL_NAME or kept >= RECYCLE_MAX_FILES or info.st_size > room
                if skip or not stat.S_ISREG(info.st_mode):
                    continue
                if not _recycle(Path(entry.path), pool / f"{info.st_size:020d}-{secrets.token_hex(8)}"):
                    continue
                room -= info.st_size
                kept += 1
    shutil.rmtree(step.path, ignore_errors=True)


def _recycle(path: Path, to: Path) -> bool:
    """Move a leaving step's file into the recycle pool, unless a restore maps it (`fsio.try_lock`): such a
    file is only deleted, so the reader's pages keep their bytes."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if not try_lock(fd, exclusive=True):
            return False
        os.rename(path, to)
        return True
    finally:
        os.close(fd)


def _recycled(root: Path) -> list[tuple[int, Path]]:
    found = []
    for entry in _children(root / RECYCLE_DIR):
        size, dash, _ = entry.name.partition("-")
        if dash and size.isdigit() and entry.is_file(follow_symlinks=False):
            found.append((int(size), Path(entry.path)))
    return sorted(found)


def recycled_bytes(root: Path) -> int:
    return sum(size for size, _ in _recycled(root))


def take_recycled(root: Path, size: int) -> Path | None:
    """A file of the recycle pool with at least `size` bytes (the smallest), now this caller's alone (renamed to a
    name of its own: a concurrent writer cannot take it too), to overwrite in place; None when none fits. Its
    pages are already allocated: overwriting them costs half the CPU of filling a new tmpfs file (measured:
    0.08 s against 0.18 s for 256 MiB, hashing included)."""
    for found, path in _recycled(root):
        if found < size:
            continue
        claimed = path.with_name(f".taken-{secrets.token_hex(8)}")
        try:
            os.rename(path, claimed)
        except OSError:
            continue  # another writer took it
        return claimed
    return None


def evict(config: DCSConfig, client: redis.Redis, keys: Keys, run: str | None = None) -> list[MemoryStep]:
    """Apply the eviction rule to the memory root (one base run, or all); returns the steps removed. Redis
    unreachable: nothing leaves (whether a copy exists elsewhere is unknown)."""
    root = memory_root(config)
    held = scan(root, run)
    # room for one more step as big as the biggest held: else the next save would not fit and go to storage
    over = used_bytes(root) + max((s.nbytes for s in held), default=0) - config.memory_tier_bytes
    book = Places(client, keys)
    removed: list[MemoryStep] = []
    host = config.host_name
    copies = [s for s in (held if run is None else scan(root)) if s.peer and s.committed] if over > 0 else []
    for s in sorted(copies, key=lambda s: (s.step, s.run, s.rank)):
        if over <= 0:  # over budget: peer copies leave first, oldest first
            break
        with contextlib.suppress(redis.RedisError):
            book.forget(s.run, s.step, s.rank, peer_place(host))
        remove_step(s, root, config.memory_tier_bytes - used_bytes(root) - recycled_bytes(root))
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
        for s in evictable([s for s in held if s.run == name], places, host, config.memory_keep_last, over):
            with contextlib.suppress(redis.RedisError):
                book.forget(name, s.step, s.rank, mem_place(host), peer_place(host))
            # the pool keeps what the budget leaves free: with storage every N steps, about N steps leave at once
            # after each flush and the next N saves overwrite their pages (new tmpfs pages cost their zeroing)
            remove_step(s, root, config.memory_tier_bytes - used_bytes(root) - recycled_bytes(root))
            _prune(root, s.path)
            over -= s.nbytes
            removed.append(s)
            log.info("memory tier: step %d of %s rank %d left memory (%d bytes)", s.step, name, s.rank, s.nbytes)
    trim_pool(root, config.memory_tier_bytes - used_bytes(root))
    return removed


def _prune(root: Path, step_dir: Path) -> None:
    """Remove the rank directory, then the run directory, that held a step which left memory, when empty."""
    parent = step_dir.parent
    for directory in (parent, parent.parent) if RANK_DIR.fullmatch(parent.name) else (parent,):
        if directory == root or not directory.is_relative_to(root) or not _is_dir(directory):
            return
        try:
            directory.rmdir()
        except OSError:
            return


def trim_pool(root: Path, allowed: int) -> None:
    """Delete recycle-pool files, largest first, until the pool holds at most `allowed` bytes (steps written into
    new pages while the pool held other sizes may have left the steps and the pool above the budget together)."""
    pool = _recycled(root)
    held = sum(size for size, _ in pool)
    for size, path in sorted(pool, reverse=True):
        if held <= max(allowed, 0):
            break
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        held -= size


# --- restore: fetching from peers --------------------------------------------------------------------------
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
        return transfer.list_steps(address, token, run, timeout=min(10.0, config.peer_timeout_seconds))
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
            timeout=config.peer_timeout_seconds,
            max_bytes=max(config.memory_tier_bytes, 1),
            accept=check,
            min_rate=config.peer_min_bytes_per_second,
            max_manifest_bytes=config.peer_max_manifest_bytes,
        )
    except CheckpointError as exc:
        log.warning("memory tier: could not fetch %s from peer %s: %s", rel, host, exc)
        return False
    log.info("memory tier: fetched %s from peer %s", rel, host)
    return True
