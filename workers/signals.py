"""Celery signal handlers: presence beacon and host agent start/stop, worker metrics export, dead-child metrics
cleanup.

Connected by `connect_signals()` at worker start.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from celery import signals

from dcs_tasks.checkpoint.agreement import effective
from dcs_tasks.checkpoint.store.tiers import memdir
from dcs_tasks.storage import s3_settings
from dcs_tasks.storage.s3 import prewarm
from dcs_tasks.storage_url import ObjectURL
from workers.agent import start_host_agent, stop_host_agent
from workers.memory import start_peer_server, stop_peer_server
from workers.presence import PresenceBeacon
from workers.prometheus import mark_dead, start_exporter
from workers.runtime import runtime

log = logging.getLogger(__name__)
_beacon: PresenceBeacon | None = None


def _on_worker_ready(sender: Any = None, **_: Any) -> None:
    global _beacon
    rt = runtime()
    queues = [q.name for q in sender.app.amqp.queues.consume_from.values()]
    settings = effective(rt.config, worker=f"{sender.hostname} pid={os.getpid()}").model_dump_json()
    _beacon = PresenceBeacon(rt.redis, rt.keys, queues, worker_name=str(sender.hostname), settings=settings)
    _beacon.start()
    start_exporter(rt.config)
    start_host_agent(rt.config)  # trainers, receivers and attach sidecars of this host beat through it
    start_peer_server(rt.config)  # the memory tier's copies to and from peer hosts


def _on_worker_shutdown(**_: Any) -> None:
    stop_peer_server()
    stop_host_agent()
    if _beacon is not None:
        _beacon.stop()


def _on_child_exit(pid: int | None = None, **_: Any) -> None:
    mark_dead(pid if pid is not None else os.getpid())


def _prewarm_object_store(**_: Any) -> None:
    """With an object-store root, load the S3 client before the first task needs it (parent and each child)."""
    config = runtime().config
    if any(isinstance(root, ObjectURL) for root in (config.checkpoint.dir, config.checkpoint.replica_dir)):
        try:
            prewarm(s3_settings(config))
        except Exception as exc:  # a task that needs the client reports the problem with its context
            log.warning("could not prepare the S3 client: %s: %s", type(exc).__name__, exc)


def _open_memory_tier(**_: Any) -> None:
    """With the memory tier on, tell the storage factory of its directory before the pool forks, so every child
    routes the tier's paths to its store (`memdir.memory_root`) from its first task on."""
    config = runtime().config
    if memdir.enabled(config):
        try:
            memdir.memory_root(config, create=True)
        except Exception as exc:  # the peer server's start, and each task that needs the tier, name the problem
            log.warning("could not open the memory tier's directory: %s: %s", type(exc).__name__, exc)


def connect_signals() -> None:
    signals.worker_init.connect(_open_memory_tier, weak=False)
    signals.worker_init.connect(_prewarm_object_store, weak=False)
    signals.worker_process_init.connect(_prewarm_object_store, weak=False)
    signals.worker_process_shutdown.connect(_on_child_exit, weak=False)
    signals.worker_ready.connect(_on_worker_ready, weak=False)
    signals.worker_shutdown.connect(_on_worker_shutdown, weak=False)
