"""Helpers for coordinator tests: an in-process app (real lifespan, real Redis) and clients on it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
from fastapi import FastAPI

from coordinator.app import create_app
from dcs_tasks.config import DCSConfig, TopologyConfig
from dcs_tasks.coordinator_api import CoordinatorAPI


@dataclass
class InProcessCoordinator:
    app: FastAPI
    api: CoordinatorAPI  # typed client, token from the config
    http: httpx.AsyncClient  # raw client without any token, for malformed requests
    authed: httpx.AsyncClient  # raw client with the config's token: malformed requests past the auth check


@asynccontextmanager
async def in_process_coordinator(
    config: DCSConfig, topology: TopologyConfig | None = None
) -> AsyncIterator[InProcessCoordinator]:
    """`create_app(config)` with its lifespan running, reached through httpx's ASGI transport."""
    app = create_app(config, topology)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        api = CoordinatorAPI("http://coordinator", config.token(), timeout=10.0, transport=transport)
        token = config.token()
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        async with (
            httpx.AsyncClient(transport=transport, base_url="http://coordinator", timeout=10.0) as http,
            httpx.AsyncClient(
                transport=transport, base_url="http://coordinator", timeout=10.0, headers=headers
            ) as authed,
        ):
            try:
                yield InProcessCoordinator(app=app, api=api, http=http, authed=authed)
            finally:
                await api.aclose()
