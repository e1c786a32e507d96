"""The weight-meta log: senders append bucket descriptions, receivers read them by index with a long-poll.

Entries live in a Redis list (RPUSH / LRANGE) holding at most `max_entries`; indices are absolute (a base
counter moves past entries trimmed at append or dropped by `clear`), so a reader's index stays valid
across both and a reader that fell behind is told where its entries resume (`first_index`). Each append
also PUBLISHes on `weight_meta_channel`; one `AppendNotifier` per coordinator process listens there and
wakes its waiting long-polls, so a waiting request costs no Redis traffic until something is appended (or
its timeout ends). Appends made through another coordinator wake this one too, because the wake-up goes
through Redis. One read is capped in entries and bytes (`ReadLimits`), so one answer, and the Redis script
behind it, stay small however long the log is; the reader continues from `next_index`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from dataclasses import dataclass

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
        self._event = asyncio.Event()
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

    def waiter(self) -> asyncio.Event:
        """An event set at the next append notification (take it BEFORE re-checking the list)."""
        return self._event

    def _wake_all(self) -> None:
        event, self._event = self._event, asyncio.Event()
        event.set()

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
        self._append = redis.register_script(scripts.APPEND_WEIGHT_META)
        self._read = redis.register_script(scripts.READ_WEIGHT_META)
        self._clear = redis.register_script(scripts.CLEAR_WEIGHT_META)

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
        return int(await self._append(keys=keys, args=args))

    async def read(self, index: int, limit: int | None = None) -> WeightMetaBatch:
        """Entries from absolute `index` (from the oldest kept one if `index` was trimmed), at most `limit`
        (and the configured caps); `end_index` says where the log ends."""
        count = self.limits.max_entries if limit is None else min(limit, self.limits.max_entries)
        keys = [self.keys.weight_meta(), self.keys.weight_meta_base()]
        base, length, raw = await self._read(keys=keys, args=[index, count, self.limits.max_bytes])
        first = max(index, int(base))
        entries = [WeightMeta.model_validate_json(item) for item in raw]
        end = int(base) + int(length)
        return WeightMetaBatch(entries=entries, next_index=first + len(entries), first_index=first, end_index=end)

    async def wait_read(self, index: int, wait_timeout_s: float, limit: int | None = None) -> WeightMetaBatch:
        """Entries from `index`; if none yet, wait up to `wait_timeout_s` for an append, then read again."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_timeout_s
        while True:
            event = self.notifier.waiter()
            batch = await self.read(index, limit)
            remaining = deadline - loop.time()
            if batch.entries or remaining <= 0 or limit == 0:
                return batch
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), timeout=remaining)

    async def clear(self) -> int:
        """Empty the log (indices keep counting); returns how many entries it held."""
        return int(await self._clear(keys=[self.keys.weight_meta(), self.keys.weight_meta_base()]))

    async def length(self) -> int:
        return int(await self.redis.llen(self.keys.weight_meta()))
