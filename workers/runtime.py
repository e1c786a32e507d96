"""Per-process worker context, set once at worker start-up (never at import time).

Tasks reach the config, Redis and key builder through `runtime()`. Prefork children inherit it
through fork; their Redis connection pool is re-created lazily after fork by redis-py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import redis

from dcs_tasks.config import DCSConfig
from dcs_tasks.keys import Keys
from dcs_tasks.redisconn import sync_client


@dataclass
class Runtime:
    config: DCSConfig
    keys: Keys = field(init=False)
    redis: redis.Redis = field(init=False)

    def __post_init__(self) -> None:
        self.keys = Keys(self.config.redis.namespace)
        self.redis = sync_client(self.config, health_check_interval=10)  # Sentinel URLs follow the master


_RUNTIME: Runtime | None = None


def init_runtime(config: DCSConfig) -> Runtime:
    global _RUNTIME
    _RUNTIME = Runtime(config)
    return _RUNTIME


def runtime() -> Runtime:
    """The worker's runtime; builds one from `DCS_*` env if the process was started without `dcs worker`."""
    if _RUNTIME is None:
        return init_runtime(DCSConfig())
    return _RUNTIME
