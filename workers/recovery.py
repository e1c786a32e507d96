"""Start-up recovery of a host's orphaned tasks.

With late acks on Redis, the tasks a dead worker had taken stay in kombu's `unacked` hash until the
visibility timeout (minutes) has passed. A node queue is served only by the workers of one host, so when a
worker starts and no other worker of its host is alive, every unacked message routed to that node queue
belonged to a dead worker: it is put back on the queue at once, through kombu's own `restore_by_tag`
(a WATCH/MULTI transaction, so two workers starting together restore each message once). Tasks are
idempotent and commits fenced, so a message restored this way is safe to run again.

Called before the worker consumes anything, so its own deliveries are never among those restored.
"""

from __future__ import annotations

import json
import logging
import os

import redis
from celery import Celery

from dcs_tasks.keys import Keys
from dcs_tasks.process import pid_alive

log = logging.getLogger(__name__)


def other_worker_alive(client: redis.Redis, keys: Keys, queue: str) -> bool:
    """True when the presence key of `queue` names a live process other than this one.

    The presence value is "<worker name> pid=<pid>"; workers of one node share its pid namespace, so a
    pid that no longer exists means the key is the leftover of a killed worker (its TTL not yet run out).
    A re-exec'd worker keeps its pid, so its own leftover key counts as dead too."""
    value = client.get(keys.worker_presence(queue))
    if value is None:
        return False
    text = value.decode() if isinstance(value, bytes) else str(value)
    _, _, pid_text = text.rpartition("pid=")
    if not pid_text.isdigit():
        return True
    pid = int(pid_text)
    return pid != os.getpid() and pid_alive(pid)


def restore_orphaned(app: Celery, client: redis.Redis, keys: Keys, queue: str) -> int:
    """Requeue the unacked messages of `queue` when no other worker of this host is alive; returns how many."""
    if other_worker_alive(client, keys, queue):
        return 0
    with app.connection_for_write() as conn:
        channel = conn.default_channel
        unacked = channel.client.hgetall(channel.unacked_key)
        tags = [tag for tag, raw in unacked.items() if _routing_key(raw) == queue]
        for tag in tags:
            channel.qos.restore_by_tag(tag, channel.client)
    if tags:
        log.warning("restored %d task(s) of %s left unacknowledged by a dead worker", len(tags), queue)
    return len(tags)


def _routing_key(raw: bytes | str) -> str | None:
    try:
        _message, _exchange, routing_key = json.loads(raw)
    except (ValueError, TypeError):
        return None
    return routing_key if isinstance(routing_key, str) else None
