"""HTTP client of one SGLang server, as the attach sidecar sees it: `/health` and the server info.

The API key travels as SGLang's middleware expects it, `Authorization: Bearer <key>`
(sglang/srt/utils/auth.py). SGLang lets `/health` through without a key, so a wrong key only shows on
the server info read, which is why `server_info` turns 401/403 into `EngineAuthError`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from types import TracebackType

import httpx

from dcs_tasks.engine.errors import EngineAuthError, EngineError, EngineUnavailable, UnsupportedEngine
from dcs_tasks.engine.server_info import SERVER_INFO_PATHS, EngineServerInfo, parse_server_info

log = logging.getLogger(__name__)


class EngineClient:
    """`base_url` is the engine as this host reaches it; `api_key` is sent on every request (never logged)."""

    def __init__(self, base_url: str, api_key: str | None, timeout: float) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = base_url.rstrip("/")
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=timeout)

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._http.aclose()

    async def health(self, timeout: float) -> str | None:
        """None when `GET /health` answers 200 within `timeout`, else why not (for the log)."""
        try:
            response = await self._http.get("/health", timeout=timeout)
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return None if response.status_code == 200 else f"/health answered {response.status_code}"

    async def wait_healthy(self, timeout: float, poll: float, health_timeout: float) -> None:
        """Poll `/health` until it answers 200; EngineUnavailable after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            reason = await self.health(health_timeout)
            if reason is None:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineUnavailable(
                    f"engine at {self.base_url} did not answer GET /health with 200 within {timeout:g}s "
                    f"(last: {reason}); is the SGLang server started, and is --engine-url right?"
                )
            await asyncio.sleep(min(poll, left))

    async def server_info(self) -> EngineServerInfo:
        """The first of `SERVER_INFO_PATHS` the engine serves, parsed (typed errors for refusals)."""
        for path in SERVER_INFO_PATHS:
            try:
                response = await self._http.get(path)
            except httpx.HTTPError as exc:
                raise EngineError(f"engine at {self.base_url} failed GET {path}: {exc!r}") from exc
            if response.status_code == 404:
                continue
            if response.status_code in (401, 403):
                raise EngineAuthError(
                    f"engine at {self.base_url} refused the API key on GET {path} ({response.status_code}): "
                    "start it with --api-key set to the key this sidecar sends (--engine-api-key, "
                    "DCS_ENGINE_API_KEY, else DCS_AUTH_TOKEN)"
                )
            if not response.is_success:
                raise EngineError(f"engine at {self.base_url} answered {response.status_code} to GET {path}")
            try:
                payload = response.json()
            except ValueError:
                raise UnsupportedEngine(f"GET {path} at {self.base_url} did not answer JSON") from None
            return parse_server_info(payload, f"GET {path} at {self.base_url}")
        raise UnsupportedEngine(
            f"engine at {self.base_url} serves none of {', '.join(SERVER_INFO_PATHS)}: not an SGLang server"
        )
