"""Celery signal handlers: presence beacon start/stop, worker metrics export, dead-child metrics cleanup.

Connected by `connect_signals()` at worker start.
"""

from __future__ import annotations

import os
from typing import Any

from celery import signals

from workers.metrics import mark_dead, start_exporter
from workers.presence import PresenceBeacon
from workers.runtime import runtime

_beacon: PresenceBeacon | None = None


def _on_worker_ready(sender: Any = None, **_: Any) -> None:
    global _beacon
    rt = runtime()
    queues = [q.name for q in sender.app.amqp.queues.consume_from.values()]
    _beacon = PresenceBeacon(rt.redis, rt.keys, queues, worker_name=str(sender.hostname))
    _beacon.start()
    start_exporter(rt.config)


def _on_worker_shutdown(**_: Any) -> None:
    if _beacon is not None:
        _beacon.stop()


def _on_child_exit(pid: int | None = None, **_: Any) -> None:
    mark_dead(pid if pid is not None else os.getpid())


def connect_signals() -> None:
    signals.worker_process_shutdown.connect(_on_child_exit, weak=False)
    signals.worker_ready.connect(_on_worker_ready, weak=False)
    signals.worker_shutdown.connect(_on_worker_shutdown, weak=False)
