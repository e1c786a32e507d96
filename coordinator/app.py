"""`create_app(config)`: the coordinator's FastAPI application.

The app holds no state of its own (invariant 7): topology, heartbeats and weight meta live in Redis, so
any number of coordinator processes on one Redis answer alike and a restart loses nothing. Redis
connections are made in the lifespan, never at import. Redis unreachable -> 503 with a JSON `detail`;
the next request after Redis returns reconnects by itself.

Every error answer is JSON `{"detail": "..."}` (400, 401, 403, 404, 405, 409, 413, 422, 500, 503), `detail`
always a string (see `coordinator.responses`), and no answer or log line carries a secret (the token, a
Redis password: `DCSConfig.scrub`). Cross-site browser requests are refused (403, `BrowserGuardMiddleware`).
Redis connections come from a bounded blocking pool: a burst of requests waits for a free connection
(up to DCS_REDIS_POOL_TIMEOUT_SECONDS) instead of failing. With a token configured,
the OpenAPI schema and its pages (/openapi.json, /docs, /redoc) need the token too (invariant 9), so a
browser cannot open /docs then: fetch the schema with `curl -H "Authorization: Bearer $DCS_AUTH_TOKEN"`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import redis.asyncio as aioredis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from coordinator.deps import Services
from coordinator.hotpaths import HotPaths
from coordinator.middleware import (
    UNAUTHORIZED,
    BrowserGuardMiddleware,
    RequestMetrics,
    RequestMetricsMiddleware,
    coordinator_public,
)
from coordinator.routes import ROUTERS
from coordinator.sweeper import DeadNodeSweeper, sweep_interval
from coordinator.topology import TopologyManager
from coordinator.weight_meta import AppendNotifier, ReadLimits, WeightMetaStore
from dcs_tasks.auth import BearerAuthASGI
from dcs_tasks.config import DCSConfig, TopologyConfig
from dcs_tasks.httpguard import BodyLimitASGI
from dcs_tasks.keys import Keys
from dcs_tasks.redisconn import async_client, redis_location

log = logging.getLogger(__name__)


def make_redis(config: DCSConfig) -> aioredis.Redis:
    """An asyncio Redis client whose every call is bounded by the configured socket timeout, on a blocking pool
    of DCS_REDIS_MAX_CONNECTIONS: when all are busy a call waits up to DCS_REDIS_POOL_TIMEOUT_SECONDS for one
    (then a ConnectionError, i.e. 503) instead of failing at once. A Sentinel URL follows the current master."""
    return async_client(config)


def _build_services(config: DCSConfig, topology_config: TopologyConfig, metrics: RequestMetrics) -> Services:
    client = make_redis(config)
    keys = Keys(config.redis.namespace)
    notifier = AppendNotifier(client, keys.weight_meta_channel())
    return Services(
        config=config,
        redis=client,
        topology=TopologyManager(
            client,
            keys,
            topology_config,
            config.heartbeat.timeout_seconds,
            identity_required=config.coordinator.node_identity_required,
            unbeaten_retention_seconds=config.coordinator.unbeaten_node_retention_seconds,
            heartbeat_interval_seconds=config.heartbeat.interval_seconds,
            dead_node_retention_seconds=config.coordinator.dead_node_retention_seconds,
        ),
        weight_meta=WeightMetaStore(
            client,
            keys,
            notifier,
            config.coordinator.weight_meta_max_entries,
            ReadLimits(config.coordinator.weight_meta_read_max_entries, config.coordinator.weight_meta_read_max_bytes),
        ),
        request_metrics=metrics,
    )


async def _redis_unavailable(request: Request, exc: Exception) -> JSONResponse:
    """503 for any Redis failure: unreachable (connection, timeout, loading) or a refused command."""
    config: DCSConfig = request.app.state.config
    where = f"Redis at {redis_location(config.redis.url)}"
    if isinstance(exc, (RedisConnectionError, RedisTimeoutError)):
        what = f"{where} is unreachable or busy ({type(exc).__name__}: {exc})"
    else:
        what = f"{where} refused the command ({type(exc).__name__}: {exc})"
    detail = config.scrub(
        f"{what}; the coordinator keeps no state of its own and recovers when Redis does - retry later"
    )
    log.warning("%s %s answered 503: %s", request.method, request.url.path, detail)
    return JSONResponse(status_code=503, content={"detail": detail[:2000]}, headers={"Retry-After": "1"})


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    problems = [f"{'.'.join(str(p) for p in err.get('loc', ()))}: {err.get('msg', 'invalid')}" for err in exc.errors()]
    return JSONResponse(status_code=422, content={"detail": "invalid request: " + "; ".join(problems)})


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    """500 as JSON like every other answer (the traceback still goes to the log)."""
    config: DCSConfig = request.app.state.config
    detail = config.scrub(f"internal error in {request.method} {request.url.path}: {type(exc).__name__}: {exc}")
    return JSONResponse(status_code=500, content={"detail": detail[:2000]})


def create_app(config: DCSConfig, topology_config: TopologyConfig | None = None) -> FastAPI:
    """The coordinator app for `config`; `topology_config` (role mappings, order) overrides the config's."""
    topo_config = topology_config or config.topology_config()
    metrics = RequestMetrics(CollectorRegistry(auto_describe=True))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        services = _build_services(config, topo_config, metrics)
        app.state.services = services
        retention = config.coordinator.dead_node_retention_seconds
        interval = sweep_interval(
            config.heartbeat.timeout_seconds, min(retention, config.coordinator.unbeaten_node_retention_seconds)
        )
        sweeper = DeadNodeSweeper(services.topology, retention, interval)
        services.weight_meta.notifier.start()
        sweeper.start()
        try:
            yield
        finally:
            await sweeper.stop()
            await services.weight_meta.notifier.stop()
            await services.redis.aclose()

    app = FastAPI(title="DCS coordinator", version="0.1.0", lifespan=lifespan)
    app.state.config = config
    for router in ROUTERS:
        app.include_router(router)
    app.add_exception_handler(RedisError, _redis_unavailable)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _internal_error)
    # added last = outermost: metrics see every answer, auth runs before the body is read; the hot paths are
    # served innermost, behind every check (coordinator.hotpaths)
    app.add_middleware(HotPaths)
    app.add_middleware(BodyLimitASGI, max_bytes=config.coordinator.max_body_bytes, setting="DCS_MAX_BODY_BYTES")
    app.add_middleware(BrowserGuardMiddleware)
    token = config.token()
    if token:
        app.add_middleware(BearerAuthASGI, token=token, is_public=coordinator_public, body=UNAUTHORIZED)
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics)
    return app
