"""The attach sidecar's probe of one engine (SGLang or vLLM server): `/health` probes and one server-info read.

SGLang lets `/health` through without a key (sglang/srt/utils/auth.py), so a wrong key only shows on the
server-info read, which goes through the trainer's `EngineAPI.probe` (`Authorization: Bearer <key>`,
401/403 -> `EngineAuthRefused`, refused versions and layouts -> `EngineIncompatible`).
"""

from __future__ import annotations

import asyncio
import time
import urllib.parse
from types import TracebackType
from typing import NamedTuple

from dcs_tasks.engine_http import EngineHTTP, EngineHTTPError
from dcs_tasks.errors import DCSTimeoutError
from dcs_tasks.sync.engine_protocol import EngineAPI
from dcs_tasks.sync.wire import EngineEndpoint, EngineInfo, EngineKind


class EngineUnavailable(DCSTimeoutError):
    """The engine's `GET /health` did not answer 200 within the bounded wait."""


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


class EngineProbe:
    """The engine at `url` (http://host:port as this host reaches it), registered as rollout `rank`.

    `api_key` is sent on the server-info read and never logged."""

    def __init__(
        self,
        url: str,
        rank: int,
        api_key: str | None,
        timeout: float,
        kind: EngineKind = "sglang",
        colocated: bool = False,
    ) -> None:
        """`colocated`: the engine is registered as colocated with a trainer rank (a vLLM one must run the
        plugin's "dcs-ipc" backend)."""
        parsed = urllib.parse.urlsplit(url)
        self.base_url = url.rstrip("/")
        self.kind = kind
        self.colocated = colocated
        self.endpoint = EngineEndpoint(rank=rank, ip=parsed.hostname or "", port=parsed.port or 80, kind=kind)
        self.timeout = timeout
        self._api = EngineAPI(api_key, timeout)
        # /health needs no key. Kept alive by the shared engine client: a connection the engine closed as it was
        # reused is replaced, so an idle close (uvicorn's 5 s against a 5 s probe interval) never fails a probe
        # (an unanswered probe makes the sidecar register the engine anew, and every trainer rebuild its group)
        self._http = EngineHTTP()

    async def __aenter__(self) -> EngineProbe:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._http.aclose()
        await self._api.aclose()

    async def health(self, timeout: float) -> Health:
        """One `GET /health` bounded by `timeout`."""
        try:  # the whole probe within `timeout`, at most MAX_BODY_BYTES of answer (a trickling /health ends)
            response = await self._http.request("GET", f"{self.base_url}/health", timeout)
        except EngineHTTPError as exc:
            return Health(None, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
        return Health(response.status, f"answered {response.status}")

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
        """`GET /server_info` (or `/get_server_info`; vLLM: `/version` and `/get_world_size`), judged as the
        trainer judges it (typed refusals)."""
        return await self._api.probe(self.endpoint, self.timeout, self.colocated)
