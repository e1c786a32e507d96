"""Celery signal handlers: presence beacon start/stop. Connected by `connect_signals()` at worker start."""

from __future__ import annotations

from typing import Any

from celery import signals

from workers.presence import PresenceBeacon
from workers.runtime import runtime

_beacon: PresenceBeacon | None = None


def _on_worker_ready(sender: Any = None, **_: Any) -> None:
    global _beacon
    rt = runtime()
    queues = [q.name for q in sender.app.amqp.queues.consume_from.values()]
    _beacon = PresenceBeacon(rt.redis, rt.keys, queues, worker_name=str(sender.hostname))
    _beacon.start()


def _on_worker_shutdown(**_: Any) -> None:
    if _beacon is not None:
        _beacon.stop()


def connect_signals() -> None:
    signals.worker_ready.connect(_on_worker_ready, weak=False)
    signals.worker_shutdown.connect(_on_worker_shutdown, weak=False)
