"""The memory tier's record of where each step lives, in Redis (store stage: no torch), and the names of places.

Where a step lives is recorded in Redis (`Keys.step_places`, one hash per base run, one field per place so that
workers never race on a read-modify-write): `mem@<host>` (committed in the memory of the rank's host),
`peer@<host>` (a peer copy, verified on arrival), `replicated` (every peer copy the placement asked for verified),
`storage` (copied to `checkpoint_dir` and verified there); and two marks, `flushing` and `copying`, while a flush
or a peer copy of the step is under way (recorded when it is sent, dropped when it ends). A place is recorded
only after the bytes are verified at it and dropped before they are deleted from it, so the hash may lag (a place
recorded late), never lie in the unsafe direction for long: eviction reads it to decide whether another copy
exists.
"""

from __future__ import annotations

import logging
import re
import time

import redis

from dcs_tasks.checkpoint.format.layout import RANK_DIR, STEP_DIR
from dcs_tasks.keys import Keys

log = logging.getLogger(__name__)

MEMORY, STORAGE, REPLICATED = "memory", "storage", "replicated"


FLUSHING, COPYING = "flushing", "copying"  # a flush / peer copy of the step is under way: it may not leave memory


MARKS = {REPLICATED, FLUSHING, COPYING}  # fields that are not places


MEM_PREFIX, PEER_PREFIX = "mem@", "peer@"


MAX_PLACE_FIELDS = 100_000  # a hash bigger than this is not read (a hostile or runaway record)


KEPT_STEPS_IN_PLACES = 256  # the places of a run's older steps are dropped from the hash


HOST_RE = re.compile(r"^[A-Za-z0-9._:-]{1,255}$")


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


class Places:
    """Where the steps of runs live (module docstring). Every method may raise redis.RedisError."""

    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self._redis = client
        self._keys = keys

    def record(self, run: str, step: int, rank: int, *places: str, clearing: tuple[str, ...] = ()) -> None:
        """Record `places` of the step's rank; `clearing`: fields removed in the same transaction (a reader never
        sees the step both `replicated` and still `copying`)."""
        key = self._keys.step_places(run)
        now = f"{time.time():.3f}"
        pipe = self._redis.pipeline(transaction=bool(clearing))
        pipe.hset(key, mapping={f"{step}|{rank}|{p}": now for p in places})
        if clearing:
            pipe.hdel(key, *(f"{step}|{rank}|{p}" for p in clearing))
        pipe.hlen(key)
        size = pipe.execute()[-1]
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
        if host == place or not HOST_RE.fullmatch(host):
            return None
    return int(parts[0]), int(parts[1]), place
