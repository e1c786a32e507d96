"""The Celery app for Celery's own command line: `celery -A workers.celery inspect ping`, `... flower`.

Celery's CLI (and Flower, which runs under it) needs an importable module holding an app. This one is built
at import from `DCSConfig()`, i.e. from the `DCS_*` environment (`DCS_REDIS_URL` above all), with the same
settings as every DCS process (`make_celery`: JSON only, task events on, the same queues), so inspect, control
and Flower talk to the broker the workers use and accept only JSON.

It is a client app: no task modules, no worker runtime. Workers are started with `dcs worker` (which adds the
task modules, the presence beacon and orphan recovery); `celery -A workers.celery worker` is refused, because
a worker without DCS's task modules would take tasks off the queues and drop them as unregistered.
"""

from __future__ import annotations

from typing import Any

from celery import Celery, signals

from dcs_tasks.celery_app import make_celery
from dcs_tasks.config import DCSConfig

WORKER_REFUSED = (
    "workers.celery is the app for `celery inspect`, `celery control` and Flower only; start a DCS worker with "
    "`dcs worker` (a plain Celery worker has no DCS task modules and would drop the tasks it takes)"
)


def _refuse_worker(sender: Any = None, instance: Any = None, **_: Any) -> None:
    """`celeryd_init` runs before a worker connects to the broker: stop a worker of this app there."""
    if instance is not None and getattr(instance, "app", None) is app:
        raise SystemExit(f"error: {WORKER_REFUSED}")  # Celery's signal dispatch swallows Exception, not this


app: Celery = make_celery(DCSConfig())
signals.celeryd_init.connect(_refuse_worker, weak=False)
