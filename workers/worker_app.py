"""The worker-side Celery app: `make_celery` plus the task modules and signal handlers."""

from __future__ import annotations

from celery import Celery

from dcs_tasks.celery_app import check_visibility_timeout, make_celery
from dcs_tasks.config import DCSConfig
from workers.runtime import init_runtime
from workers.signals import connect_signals

TASK_MODULES = ("workers.tasks", "workers.ckpt_tasks", "workers.sync_tasks")


def make_worker_app(config: DCSConfig) -> Celery:
    check_visibility_timeout(config)
    init_runtime(config)
    connect_signals()
    return make_celery(config, include=TASK_MODULES)
