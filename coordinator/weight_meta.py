"""The weight-meta log: senders append bucket descriptions, receivers read them by index with a long-poll.

Entries live in a Redis list (RPUSH / LRANGE) holding at most `max_entries`; indices are absolute (a base
counter moves past entries trimmed at append or dropped by `clear`), so a reader's index stays valid
across both and a reader that fell behind is told where its entries resume (`first_index`). Each append
also PUBLISHes on `weight_meta_channel`; one `AppendNotifier` per coordinator process listens there and
wakes its waiting long-polls, so a waiting request costs no Redis traffic until something is appended (or
its timeout ends). Appends made through another coordinator wake this one too, because the wake-up goes
through Redis. One read is capped in entries and bytes (`ReadLimits`), so one answer, and the Redis script
behind it, stay small however long the log is; the reader continues from `next_index`.

Reads are shared within a process (`SharedReads`): every request of this process wanting the same (index,
limit) joins one pending read, issued after all of them arrived, so an append that wakes 300 long-polls at one
index costs one script call, one parse and one JSON encoding (`Answer.body`), not 300; the answers are handed
back one per event-loop turn so heartbeats are served in between. Nothing outlives the read: the next request
starts a new one, so no answer predates its request (an append or a clear before it is seen).

Only an append wakes a long-poll: heartbeats, registrations and clears publish nothing (a clear moves no index a
reader waits at), and one append wakes each waiting poll of this process once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import cached_property

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from coordinator import scripts
from dcs_tasks.keys import Keys
from dcs_tasks.models import WeightMeta, WeightMetaBatch

log = logging.getLogger(__name__)

APPEND_MARKER_TTL_MS = 60_000  # far longer than the client's retries of one command


class AppendNotifier:
    """Turns pub/sub messages on one channel into an asyncio wake-up for every waiter of this process.

    If the subscription drops (Redis restart), it resubscribes with a short backoff; waiters still end at
    their own timeout and re-read the list, so a lost message delays an answer but never loses an entry.
    """

    def __init__(
        self, redis: aioredis.Redis, channel: str, reconnect_delay_s: float = 0.5, poll_s: float = 0.5
    ) -> None:
        self.redis = redis
        self.channel = channel
        self.reconnect_delay_s = reconnect_delay_s
        self.poll_s = poll_s
        self._stopping = False
        self._waiters: set[asyncio.Future[None]] = set()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._listen_forever(), name="dcs-weight-meta-notifier")

    async def stop(self) -> None:
        """Ends the listener within ~`poll_s` even if redis-py swallows the cancellation of a blocking read."""
        task, self._task = self._task, None
        if task is None:
            return
        self._stopping = True
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=self.poll_s * 4)
        if not done:
            log.warning("weight-meta notifier did not stop in time; abandoning it")

    def waiter(self) -> asyncio.Future[None]:
        """A future done at the next append notification (take it BEFORE re-checking the list); `forget` it
        once done with it. One plain future per waiter: waking 300 costs 300 callbacks, not 300 tasks."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.add(waiter)
        return waiter

    async def wait(self, waiter: asyncio.Future[None], timeout_s: float) -> None:
        """Until `waiter` is woken or `timeout_s` seconds pass."""
        handle = asyncio.get_running_loop().call_later(timeout_s, _finish, waiter)
        try:
            await waiter
        finally:
            handle.cancel()

    def forget(self, waiter: asyncio.Future[None]) -> None:
        self._waiters.discard(waiter)

    def _wake_all(self) -> None:
        waiters, self._waiters = self._waiters, set()
        for waiter in waiters:
            _finish(waiter)

    async def _listen_forever(self) -> None:
        while not self._stopping:
            try:
                await self._listen_once()
            except (RedisError, OSError) as exc:
                log.warning("weight-meta subscription lost (%r); resubscribing", exc)
            self._wake_all()  # re-read after a gap: something may have been appended meanwhile
            if not self._stopping:
                await asyncio.sleep(self.reconnect_delay_s)

    async def _listen_once(self) -> None:
        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(self.channel)
            while not self._stopping:
                message = await pubsub.get_message(timeout=self.poll_s)
                if message is not None:
                    self._wake_all()
        finally:
            with contextlib.suppress(RedisError, OSError):
                await pubsub.aclose()


def _finish(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


@dataclass
class Answer:
    """One read's batch and, encoded once for all the requests that share it, its JSON body."""

    batch: WeightMetaBatch

    @cached_property
    def body(self) -> bytes:
        """Exactly what FastAPI's JSONResponse would send for `batch` as the route's response_model."""
        content = self.batch.model_dump(mode="json", by_alias=True)
        return json.dumps(content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode()


ReadKey = tuple[int, int]  # (absolute index, most entries)


@dataclass
class _Pending:
    waiters: list[asyncio.Future[Answer]] = field(default_factory=list)


class SharedReads:
    """One Redis read per (index, count) for all the concurrent requests of this process that want it.

    A request joins the read still pending for its key (not yet sent to Redis), so the read starts after every
    request in it arrived: no one gets an answer older than its request. At most one read per key is in
    flight; requests arriving meanwhile form the next one. Answers are released `release_batch` per
    event-loop turn: each released request then sends its answer (h11, middleware) in that turn, and smaller
    turns let the beats waiting for the loop in (bench/fleet_heartbeats.py: 8 -> p99 16-27 ms, 4 -> 11-13 ms;
    with the polls served by `coordinator.hotpaths`, 4 -> 8-10 ms, 1 -> 5-7 ms on a busy 2-core VM).
    """

    def __init__(self, fetch: Callable[[int, int], Awaitable[Answer]], release_batch: int = 1) -> None:
        self.fetch = fetch
        self.release_batch = release_batch
        self._pending: dict[ReadKey, _Pending] = {}
        self._busy: set[ReadKey] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def read(self, index: int, count: int) -> Answer:
        key = (index, count)
        pending = self._pending.setdefault(key, _Pending())
        waiter: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        pending.waiters.append(waiter)
        if key not in self._busy:
            self._busy.add(key)
            task = asyncio.create_task(self._drain(key), name="dcs-weight-meta-read")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return await waiter

    async def _drain(self, key: ReadKey) -> None:
        """Runs the pending read of `key`, then the one that formed meanwhile, until none is left."""
        try:
            while (pending := self._pending.pop(key, None)) is not None:
                try:
                    answer = await self.fetch(*key)
                except asyncio.CancelledError:  # shutting down: its requests end too
                    for waiter in pending.waiters:
                        waiter.cancel()
                    raise
                except Exception as exc:  # every request of this read gets the error (503 for Redis's)
                    for waiter in pending.waiters:
                        if not waiter.done():
                            waiter.set_exception(exc)
                    continue
                await self._release(pending.waiters, answer)
        finally:
            self._busy.discard(key)

    async def _release(self, waiters: list[asyncio.Future[Answer]], answer: Answer) -> None:
        for start in range(0, len(waiters), self.release_batch):
            if start:
                await asyncio.sleep(0)  # one loop turn: the released requests answer, other I/O is served
            for waiter in waiters[start : start + self.release_batch]:
                if not waiter.done():
                    waiter.set_result(answer)


@dataclass(frozen=True)
class ReadLimits:
    """Most entries and bytes of entries one read returns (the first entry always, whatever its size)."""

    max_entries: int = 1000
    max_bytes: int = 4 * 1024 * 1024


class WeightMetaStore:
    """Append, read from an index (optionally waiting), and clear the weight-meta log."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        notifier: AppendNotifier,
        max_entries: int = 0,
        limits: ReadLimits | None = None,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.notifier = notifier
        self.max_entries = max_entries
        self.limits = limits or ReadLimits()
        self.shared = SharedReads(self._fetch)

    async def append(self, meta: WeightMeta | str, append_id: str | None = None) -> int:
        """Append one entry (a WeightMeta or its JSON) and wake readers; returns its absolute index + 1.

        Exactly once per `append_id` (default: a fresh one per call) even when the Redis client retries the
        command after a lost reply, so a receiver never sees a bucket twice.
        """
        marker = self.keys.weight_meta_append(append_id or uuid.uuid4().hex)
        keys = [self.keys.weight_meta(), marker, self.keys.weight_meta_base()]
        args: list[str | int] = [
            meta if isinstance(meta, str) else meta.model_dump_json(),
            self.keys.weight_meta_channel(),
            APPEND_MARKER_TTL_MS,
            self.max_entries,
        ]
        return int(await scripts.APPEND_WEIGHT_META.run_async(self.redis, keys, args))

    def _count(self, limit: int | None) -> int:
        return self.limits.max_entries if limit is None else min(limit, self.limits.max_entries)

    async def _fetch(self, index: int, count: int) -> Answer:
        keys = [self.keys.weight_meta(), self.keys.weight_meta_base()]
        base, length, raw = await scripts.READ_WEIGHT_META.run_async(
            self.redis, keys, [index, count, self.limits.max_bytes]
        )
        first = max(index, int(base))
        entries = [WeightMeta.model_validate_json(item) for item in raw]
        end = int(base) + int(length)
        batch = WeightMetaBatch(entries=entries, next_index=first + len(entries), first_index=first, end_index=end)
        return Answer(batch)

    async def read(self, index: int, limit: int | None = None) -> WeightMetaBatch:
        """Entries from absolute `index` (from the oldest kept one if `index` was trimmed), at most `limit`
        (and the configured caps); `end_index` says where the log ends."""
        return (await self.shared.read(index, self._count(limit))).batch

    async def wait_read(self, index: int, wait_timeout_s: float, limit: int | None = None) -> WeightMetaBatch:
        """Entries from `index`; if none yet, wait up to `wait_timeout_s` for an append, then read again."""
        return (await self.wait_answer(index, wait_timeout_s, limit)).batch

    async def wait_answer(self, index: int, wait_timeout_s: float, limit: int | None = None) -> Answer:
        """`wait_read` with the answer's JSON body (encoded once for every request sharing the read)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_timeout_s
        count = self._count(limit)
        while True:
            woken = self.notifier.waiter()  # taken before the read: an append after it wakes it
            try:
                answer = await self.shared.read(index, count)
                remaining = deadline - loop.time()
                if answer.batch.entries or remaining <= 0 or count == 0:
                    return answer
                await self.notifier.wait(woken, remaining)
            finally:
                self.notifier.forget(woken)

    async def clear(self) -> int:
        """Empty the log (indices keep counting); returns how many entries it held."""
        return int(
            await scripts.CLEAR_WEIGHT_META.run_async(
                self.redis, [self.keys.weight_meta(), self.keys.weight_meta_base()]
            )
        )

    async def length(self) -> int:
        return int(await self.redis.llen(self.keys.weight_meta()))
