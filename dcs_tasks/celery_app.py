"""Celery application factory shared by clients (which only send tasks by name) and workers.

Settings follow docs/reliability.md: JSON only, late acks with redelivery on worker loss,
prefetch 1, a visibility timeout larger than the longest task plus its retry backoff (checked by
`check_visibility_timeout`), task events on for Flower.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

from celery import Celery
from kombu import Exchange, Queue

from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import ConfigError
from dcs_tasks.redisconn import celery_urls

CONTROL_QUEUE = "dcs.control"
NODE_QUEUE_PREFIX = "dcs.node."


class TaskName(str, enum.Enum):
    """Registered task names. Clients call `app.send_task(TaskName.X.value, ...)`."""

    PING = "dcs.ping"
    PERSIST = "dcs.ckpt.persist"
    COMMIT = "dcs.ckpt.commit"
    RETENTION = "dcs.ckpt.retention"
    REPLICATE = "dcs.ckpt.replicate"
    FLUSH = "dcs.ckpt.flush"
    PEER_COPY = "dcs.ckpt.peer_copy"
    BOOTSTRAP_GROUP = "dcs.sync.bootstrap_group"
    JOIN_ENGINE = "dcs.sync.join_engine"
    DESTROY_GROUP = "dcs.sync.destroy_group"


def node_queue(host_name: str) -> str:
    """The queue served only by the worker(s) of one host."""
    return f"{NODE_QUEUE_PREFIX}{host_name}"


def celery_settings(config: DCSConfig) -> dict[str, Any]:
    """The Celery configuration mapping for `config` (pure; no connection is made)."""
    visibility = int(config.task.visibility_timeout_seconds)
    transport = {"visibility_timeout": visibility, "socket_timeout": config.redis.socket_timeout_seconds}
    # kombu scans for unacked messages of dead workers every interval * throttle seconds (default 10 * 10):
    # scan every 10 s, so a task of a worker killed with -9 returns ~visibility_timeout after it was taken
    broker_transport = {**transport, "unacked_restore_throttle": 1}
    urls = celery_urls(config)  # a Sentinel URL becomes kombu's `sentinel://h1;sentinel://h2` + master_name
    transport.update(urls["transport_options"])
    broker_transport.update(urls["transport_options"])
    return {
        "broker_url": urls["broker_url"],
        "result_backend": urls["result_backend"],
        "task_serializer": "json",
        "result_serializer": "json",
        "event_serializer": "json",
        "accept_content": ["json"],
        "result_accept_content": ["json"],
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "task_acks_on_failure_or_timeout": True,
        "worker_prefetch_multiplier": 1,
        "broker_transport_options": broker_transport,
        "result_backend_transport_options": dict(transport),
        "visibility_timeout": visibility,
        "task_soft_time_limit": config.task.soft_time_limit_seconds,
        "task_time_limit": config.task.time_limit_seconds,
        "worker_cancel_long_running_tasks_on_connection_loss": True,
        "broker_connection_retry_on_startup": True,
        "broker_connection_max_retries": None,
        "worker_send_task_events": True,
        "task_send_sent_event": True,
        "task_track_started": True,
        "result_expires": 24 * 3600,
        "result_extended": True,
        "task_default_queue": CONTROL_QUEUE,
        "task_default_exchange": "dcs",
        "task_default_routing_key": CONTROL_QUEUE,
        "worker_hijack_root_logger": False,
        "broker_heartbeat": 0,
        "redis_socket_timeout": config.redis.socket_timeout_seconds,
        "redis_socket_connect_timeout": config.redis.socket_timeout_seconds,
        "redis_retry_on_timeout": True,
    }


def worker_queues(config: DCSConfig) -> list[Queue]:
    """The queues a worker on this host consumes: its node queue and the shared control queue."""
    exchange = Exchange("dcs", type="direct")
    names = (node_queue(config.host_name), CONTROL_QUEUE)
    return [Queue(name, exchange, routing_key=name) for name in names]


def check_visibility_timeout(config: DCSConfig) -> None:
    """Refuse settings under which Redis would redeliver a task that is still running (celery#5935)."""
    backoff = config.task.retry_backoff_max_seconds * max(config.task.max_retries, 1)
    needed = config.task.time_limit_seconds + backoff
    if config.task.visibility_timeout_seconds <= needed:
        raise ConfigError(
            f"visibility_timeout_seconds={config.task.visibility_timeout_seconds:g} must exceed the task time limit "
            f"plus retry backoff ({config.task.time_limit_seconds:g} + {backoff:g} = {needed:g}); raise "
            "DCS_VISIBILITY_TIMEOUT_SECONDS or lower DCS_TASK_TIME_LIMIT_SECONDS"
        )


def make_celery(config: DCSConfig, *, include: Sequence[str] = (), main: str = "dcs") -> Celery:
    """Build a Celery app for `config`. Clients pass no `include`; workers include their task modules."""
    app = Celery(main, include=list(include), set_as_current=False)
    app.conf.update(celery_settings(config))
    app.conf.task_queues = worker_queues(config)
    return app
