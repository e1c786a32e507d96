"""Worker presence: a TTL key per consumed queue, refreshed by a thread in the worker's main process.

`save()` checks the key of its host's node queue before enqueueing, so a host without a live worker
fails at once instead of leaving a task in a queue nobody reads. A killed worker's key expires after
`PRESENCE_TTL_SECONDS`.
"""

from __future__ import annotations

import logging
import os
import threading

import redis

from dcs_tasks.keys import Keys

log = logging.getLogger(__name__)

PRESENCE_REFRESH_SECONDS = 1.0
PRESENCE_TTL_SECONDS = 5.0


class PresenceBeacon:
    def __init__(
        self, client: redis.Redis, keys: Keys, queues: list[str], worker_name: str, settings: str | None = None
    ) -> None:
        """`settings`: JSON of what this worker uses (`dcs_tasks.checkpoint.agreement`), published with presence
        under `Keys.worker_settings` of each queue, so a trainer can check it agrees."""
        self._client = client
        self._keys = [keys.worker_presence(q) for q in queues]
        self._value = f"{worker_name} pid={os.getpid()}"
        self._settings = {keys.worker_settings(q): settings for q in queues} if settings is not None else {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dcs-presence", daemon=True)

    def start(self) -> None:
        self._beat()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * PRESENCE_REFRESH_SECONDS)
        try:
            self._client.delete(*self._keys, *self._settings)
        except redis.RedisError as exc:
            log.warning("could not clear worker presence keys: %s", exc)

    def _beat(self) -> None:
        ttl_ms = int(PRESENCE_TTL_SECONDS * 1000)
        pipe = self._client.pipeline(transaction=False)
        for key in self._keys:
            pipe.set(key, self._value, px=ttl_ms)
        for key, settings in self._settings.items():
            pipe.set(key, settings, px=ttl_ms)
        pipe.execute()

    def _run(self) -> None:
        while not self._stop.wait(PRESENCE_REFRESH_SECONDS):
            try:
                self._beat()
            except redis.RedisError as exc:  # Redis restarting: keep trying, the TTL tells the truth
                log.warning("worker presence refresh failed: %s", exc)


def worker_is_present(client: redis.Redis, keys: Keys, queue: str) -> bool:
    return bool(client.exists(keys.worker_presence(queue)))
