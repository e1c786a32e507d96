"""Per-process worker context, set once at worker start-up (never at import time).

Tasks reach the config, Redis and key builder through `runtime()`. Prefork children inherit it
through fork; their Redis connection pool is re-created lazily after fork by redis-py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import redis

from dcs_tasks.config import DCSConfig
from dcs_tasks.keys import Keys


@dataclass
class Runtime:
    config: DCSConfig
    keys: Keys = field(init=False)
    redis: redis.Redis = field(init=False)

    def __post_init__(self) -> None:
        self.keys = Keys(self.config.namespace)
        self.redis = redis.Redis.from_url(
            self.config.redis_url,
            decode_responses=True,
            socket_timeout=self.config.redis_socket_timeout_seconds,
            socket_connect_timeout=self.config.redis_socket_timeout_seconds,
            health_check_interval=10,
        )


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
