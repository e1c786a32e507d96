"""The Celery app Flower loads in a local stack (`celery -A dcs_tasks.local.flower_app flower`): DCS's own
settings from the `DCS_*` environment, so Flower reaches the same broker (plain or Sentinel, with its
password) without a URL on its command line."""

from __future__ import annotations

from dcs_tasks.celery_app import make_celery
from dcs_tasks.config import DCSConfig

app = make_celery(DCSConfig())
