"""Generic tasks. Checkpoint tasks live in `workers.ckpt_tasks`, weight-sync tasks in `workers.sync_tasks`."""

from __future__ import annotations

import os
import socket
import time

from celery import shared_task

from dcs_tasks.celery_app import TaskName


@shared_task(name=TaskName.PING.value)
def ping() -> dict[str, object]:
    """Round-trip probe used by tests and the task-latency benchmark (`started_at` is wall-clock seconds)."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "started_at": time.time()}
