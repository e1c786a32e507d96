"""HTTP client of one SGLang server as the attach sidecar sees it: `/health` probes and one server-info read.

SGLang lets `/health` through without a key (sglang/srt/utils/auth.py), so a wrong key only shows on the
server-info read, which goes through the trainer's `EngineAPI.probe` (`Authorization: Bearer <key>`,
401/403 -> `EngineAuthRefused`, refused versions and layouts -> `EngineIncompatible`).
"""

from __future__ import annotations

import asyncio
import time
from types import TracebackType
from typing import NamedTuple

import httpx

from dcs_tasks.engine.errors import EngineUnavailable
from dcs_tasks.http11 import bounded_request
from dcs_tasks.sync.engine_protocol import EngineAPI
from dcs_tasks.sync.models import EngineEndpoint, EngineInfo


class Health(NamedTuple):
    """One `/health` probe: the status it answered (None: no answer at all) and a reason for the log."""

    status: int | None
    reason: str

    @property
    def ok(self) -> bool:
        return self.status == 200

    @property
    def answered(self) -> bool:
        return self.status is not None


class EngineClient:
    """The engine at `url` (http://host:port as this host reaches it), registered as rollout `rank`.

    `api_key` is sent on the server-info read and never logged."""

    def __init__(self, url: str, rank: int, api_key: str | None, timeout: float) -> None:
        parsed = httpx.URL(url)
        self.base_url = url.rstrip("/")
        self.endpoint = EngineEndpoint(rank=rank, ip=parsed.host, port=parsed.port or 80)
        self.timeout = timeout
        self._api = EngineAPI(api_key, timeout)
        # /health needs no key. A new connection per probe: a kept-alive one that the server closed while idle
        # (uvicorn's 5 s against a 5 s probe interval) would fail a probe, and an unanswered probe makes the
        # sidecar register the engine anew (a restart), which makes every trainer rebuild its group
        no_keepalive = httpx.Limits(max_keepalive_connections=0)
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=timeout, limits=no_keepalive)

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._http.aclose()
        await self._api.aclose()

    async def health(self, timeout: float) -> Health:
        """One `GET /health` bounded by `timeout`."""
        try:  # the whole probe within `timeout`, at most MAX_BODY_BYTES of answer (a trickling /health ends)
            response = await bounded_request(self._http, "GET", "/health", timeout)
        except httpx.HTTPError as exc:
            return Health(None, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
        return Health(response.status_code, f"answered {response.status_code}")

    async def wait_healthy(self, timeout: float, poll: float, health_timeout: float) -> None:
        """Poll `/health` until it answers 200; EngineUnavailable after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            probe = await self.health(health_timeout)
            if probe.ok:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineUnavailable(
                    f"engine at {self.base_url} did not answer GET /health with 200 within {timeout:g}s "
                    f"(last: {probe.reason}); is the SGLang server started, and is --engine-url right?"
                )
            await asyncio.sleep(min(poll, left))

    async def server_info(self) -> EngineInfo:
        """`GET /server_info` (or `/get_server_info`), judged as the trainer judges it (typed refusals)."""
        return await self._api.probe(self.endpoint, self.timeout)
