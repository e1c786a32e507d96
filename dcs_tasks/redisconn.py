"""The one place DCS turns `DCSConfig.redis.url` into Redis clients and Celery broker/backend settings.

Two URL forms are accepted:

- a plain Redis: `redis://[[user]:password@]host[:6379][/db]`, `rediss://...`, `unix:///path?db=0`;
- Redis Sentinel: `sentinel://[[user]:password@]host1[:26379][,host2[:26379]...]/<master_name>[/<db>]`
  with an optional `?sentinel_password=...` when the sentinels themselves require a password. The
  password in the user part is the one of the master and its replicas. Every client asks the sentinels for
  the current master on each new connection, so a failover is followed without restarting any process.

`sync_client` (trainers, workers, CLI), `async_client` (the coordinator) and `celery_urls` (broker and
result backend, in kombu's `sentinel://h1:p1;sentinel://h2:p2` form plus `master_name` transport options)
all read the same setting. Redis Cluster is not supported (Celery's Redis broker cannot use it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.asyncio.sentinel import SentinelConnectionPool as AsyncSentinelPool
from redis.backoff import ExponentialBackoff
from redis.sentinel import Sentinel

# The URL forms live in `redisurl`: `config` checks `redis_url` with them without importing Redis clients.
from dcs_tasks.redisurl import SENTINEL_PORT as SENTINEL_PORT
from dcs_tasks.redisurl import SENTINEL_SCHEME as SENTINEL_SCHEME
from dcs_tasks.redisurl import SentinelTarget as SentinelTarget
from dcs_tasks.redisurl import is_sentinel as is_sentinel
from dcs_tasks.redisurl import parse_sentinel_url as parse_sentinel_url
from dcs_tasks.redisurl import redis_location as redis_location

if TYPE_CHECKING:
    from dcs_tasks.config import DCSConfig


def _sentinel_kwargs(target: SentinelTarget, timeout: float) -> dict[str, Any]:
    """Options of the connections to the sentinels themselves."""
    kwargs: dict[str, Any] = {"socket_timeout": timeout, "socket_connect_timeout": timeout}
    if target.sentinel_password:
        kwargs["password"] = target.sentinel_password
    return kwargs


def _auth(target: SentinelTarget) -> dict[str, Any]:
    return {"username": target.username, "password": target.password, "db": target.db}


def sync_client(config: DCSConfig, *, socket_timeout: float | None = None, **options: Any) -> redis.Redis:
    """A blocking client with decoded responses, every call bounded by the socket timeout. With a Sentinel
    URL it always talks to the current master (a failover is followed on the next connection)."""
    timeout = socket_timeout or config.redis.socket_timeout_seconds
    kwargs: dict[str, Any] = {"socket_timeout": timeout, "socket_connect_timeout": timeout, **options}
    kwargs.setdefault("decode_responses", True)
    if not is_sentinel(config.redis.url):
        return redis.Redis.from_url(config.redis.url, **kwargs)
    target = parse_sentinel_url(config.redis.url)
    sentinel = Sentinel(list(target.sentinels), sentinel_kwargs=_sentinel_kwargs(target, timeout))
    client: redis.Redis = sentinel.master_for(target.master_name, **_auth(target), **kwargs)
    return client


class _BlockingSentinelPool(AsyncSentinelPool, aioredis.BlockingConnectionPool):
    """A Sentinel-managed pool that waits for a free connection like `BlockingConnectionPool`."""


def async_client(config: DCSConfig) -> aioredis.Redis:
    """The coordinator's asyncio client: decoded responses, every call bounded by the socket timeout, a
    blocking pool of DCS_REDIS_MAX_CONNECTIONS (a call waits up to DCS_REDIS_POOL_TIMEOUT_SECONDS for a free
    connection, then ConnectionError), two quick retries. Sentinel URLs follow the current master."""
    timeout = config.redis.socket_timeout_seconds
    kwargs: dict[str, Any] = {
        "max_connections": config.redis.max_connections,
        "timeout": config.redis.pool_timeout_seconds,
        "decode_responses": True,
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "retry": Retry(ExponentialBackoff(cap=0.2, base=0.02), retries=2),
        "health_check_interval": 30,
    }
    if not is_sentinel(config.redis.url):
        pool = aioredis.BlockingConnectionPool.from_url(config.redis.url, **kwargs)
        return aioredis.Redis.from_pool(pool)  # closing the client closes the pool
    target = parse_sentinel_url(config.redis.url)
    sentinel = AsyncSentinel(list(target.sentinels), sentinel_kwargs=_sentinel_kwargs(target, timeout))
    client: aioredis.Redis = sentinel.master_for(  # the client owns (and closes) its pool
        target.master_name, connection_pool_class=_BlockingSentinelPool, **_auth(target), **kwargs
    )
    return client


def celery_urls(config: DCSConfig) -> dict[str, Any]:
    """`broker_url`, `result_backend` and the transport options they need (merged into Celery's settings)."""
    url = config.redis.url
    if not is_sentinel(url):
        return {"broker_url": url, "result_backend": url, "transport_options": {}}
    target = parse_sentinel_url(url)
    auth = ""
    if target.password is not None:
        auth = f"{quote(target.username or '', safe='')}:{quote(target.password, safe='')}@"
    chunks = [
        f"sentinel://{auth if i == 0 else ''}{host}:{port}/{target.db}"
        for i, (host, port) in enumerate(target.sentinels)
    ]
    options = {
        "master_name": target.master_name,
        "sentinel_kwargs": _sentinel_kwargs(target, config.redis.socket_timeout_seconds),
    }
    joined = ";".join(chunks)
    return {"broker_url": joined, "result_backend": joined, "transport_options": options}
