"""The trainer's side of SGLang's weight-update HTTP API, by SGLang version.

Supported: SGLang 0.5.20, 0.5.21, 0.5.22 and 0.5.23 (their http_server.py, io_struct.py and weight updaters
were read against what DCS sends); any other version is refused with `EngineIncompatible` before a group
forms. Per version:

| what                                   | 0.5.20 | 0.5.21 - 0.5.23 |
| -------------------------------------- | ------ | --------------- |
| `/server_info` (version, tp/dp/pp)     | yes    | yes             |
| `/begin_weight_update`, `/end_weight_update` required around `update_weights_from_distributed` | no | yes |
| `/pause_generation` mode DCS uses, then `/continue_generation` | `abort` | `retract` |
| `/model_info` -> `weight_version` (string, `"default"` before any update) | yes | yes |
| `/get_weight_version`                  | 404    | absent          |
| `load_format="flattened_bucket"` for distributed updates | yes | yes      |

Every call carries `Authorization: Bearer <DCS_AUTH_TOKEN>` when DCS has a token (SGLang's `--api-key`,
sglang/srt/utils/auth.py); 401/403 raise `EngineAuthRefused`. Data parallelism (SGLang asserts dp_size == 1
for these calls) and pipeline stages (every stage would join with the same ranks) are refused up front.

Calls go over `dcs_tasks.engine_http.EngineHTTP`, the one client of every engine call (kept alive per engine;
0.3-0.8 ms of CPU per call on a 2-core machine, and an update makes ~5 sequential calls per engine while the
trainer packs buckets). It bounds what an engine can make DCS hold: every call takes at most its timeout in
total (not per read), an answer's body at most `engine_http.MAX_BODY_BYTES` (1 MiB); the values read here are
range-checked (a version of at most 64 characters, tp/dp/pp sizes in 1..4096, a weight version in
0..2^53-1). A bad answer is a `WeightSyncError` / `EngineIncompatible` naming that engine only.
"""

from __future__ import annotations

import asyncio
from typing import Any

from packaging.version import InvalidVersion, Version

from dcs_tasks.engine_http import Answer, EngineHTTP, EngineHTTPError
from dcs_tasks.errors import EngineAuthRefused, EngineIncompatible, UnsupportedEngineVersion, WeightSyncError
from dcs_tasks.sync import vllm_protocol
from dcs_tasks.sync.wire import EngineEndpoint, EngineInfo

SUPPORTED_VERSIONS = ("0.5.20", "0.5.21", "0.5.22", "0.5.23")
SESSIONS_SINCE = Version("0.5.21")
SERVER_INFO_PATHS = ("/server_info", "/get_server_info")
MAX_VERSION_CHARS = 64  # a version string longer than this is no SGLang version (checked before it is parsed)
MAX_ENGINE_SIZE = 4096  # tp_size / dp_size / pp_size of one engine: far above any GPU group SGLang runs
MAX_WEIGHT_VERSION = 2**53 - 1  # the coordinator's bound on versions; beyond: read as 0 (not an integer)
# Pause mode per version. `retract` sends running requests back to the queue (recomputed with the new weights)
# and, from 0.5.21, the post-update cache flush ignores that queue while paused. 0.5.20's flush needs an empty
# queue and asserts it succeeded (a failed assert kills the server), so there DCS pauses with `abort`.
RETRACT_SINCE = Version("0.5.21")


def auth_headers(token: str | None) -> dict[str, str]:
    """SGLang's API-key header (none without a token)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def engine_info(engine: EngineEndpoint, payload: Any) -> EngineInfo:
    """The protocol of the engine whose `/server_info` answered `payload`; EngineIncompatible if DCS cannot
    push to it. Only version, tp_size, dp_size and pp_size are read (the answer also holds secrets)."""
    node = engine.node_id
    if not isinstance(payload, dict) or not isinstance(payload.get("version"), str):
        raise EngineIncompatible(f"{node} at {engine.url}: /server_info has no SGLang `version`", node)
    text = payload["version"]
    if len(text) > MAX_VERSION_CHARS:
        raise EngineIncompatible(
            f"{node}: /server_info version of {len(text)} characters is not an SGLang version", node
        )
    try:
        version = Version(text)
    except (InvalidVersion, ValueError):  # ValueError: digits past int()'s limit
        raise EngineIncompatible(f"{node}: {text!r} is not an SGLang version", node) from None
    if str(version) not in SUPPORTED_VERSIONS:
        raise UnsupportedEngineVersion(
            f"{node} at {engine.url} runs SGLang {version}; DCS supports {', '.join(SUPPORTED_VERSIONS)}", node
        )
    sizes = {key: _size(payload, key, node) for key in ("tp_size", "dp_size", "pp_size")}
    if sizes["dp_size"] > 1:
        raise EngineIncompatible(
            f"{node} runs with dp_size={sizes['dp_size']}: SGLang refuses distributed weight updates with data "
            "parallelism; run one engine per replica (dp_size 1), each registered at its own rank",
            node,
        )
    if sizes["pp_size"] > 1:
        raise EngineIncompatible(f"{node} runs with pp_size={sizes['pp_size']}: DCS supports pp_size 1", node)
    return EngineInfo(
        version=str(version),
        tp_size=sizes["tp_size"],
        sessions=version >= SESSIONS_SINCE,
        flattened_bucket=True,
        pause=True,
        pause_mode="retract" if version >= RETRACT_SINCE else "abort",
    )


def _size(payload: dict[str, Any], key: str, node: str) -> int:
    value = payload.get(key, 1)
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_ENGINE_SIZE:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:40] + "..."
        raise EngineIncompatible(f"{node}: /server_info {key}={shown} is not an integer in 1..{MAX_ENGINE_SIZE}", node)
    return value


class EngineAPI:
    """HTTP calls to rollout engines, authenticated; failures raise WeightSyncError naming the engine."""

    def __init__(self, token: str | None, timeout_seconds: float) -> None:
        self._timeout = timeout_seconds
        self._headers = auth_headers(token)
        self._http = EngineHTTP(self._headers)
        # vLLM engines whose last answer was a 5xx: uvicorn closes the connection after a handler raised, without
        # saying so, so their next call goes on a connection of its own (a kept-alive one fails as it is reused)
        self._after_error: set[str] = set()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def probe(self, engine: EngineEndpoint, timeout: float, colocated: bool = False) -> EngineInfo:
        """SGLang: `GET /server_info` (the deprecated `/get_server_info` where absent) -> EngineInfo; vLLM (kind
        "vllm"): `GET /version`, `GET /get_world_size` and the weight-transfer backend of its dev-mode
        `GET /server_info` (`vllm_protocol`; `colocated`: the engine is updated by handle, backend "dcs-ipc")."""
        if engine.kind == "vllm":
            return await self._probe_vllm(engine, timeout, colocated)
        for path in SERVER_INFO_PATHS:
            response = await self._request(engine, "GET", path, None, timeout)
            if response.status == 404:
                continue
            _raise_for(engine, path, response)
            try:
                payload = response.json()
            except ValueError:
                payload = None
            return engine_info(engine, payload)
        raise EngineIncompatible(f"{engine.node_id} at {engine.url} serves no /server_info: not SGLang", engine.node_id)

    async def _probe_vllm(self, engine: EngineEndpoint, timeout: float, colocated: bool = False) -> EngineInfo:
        response = await self._request(engine, "GET", "/version", None, timeout)
        if response.status == 404:
            raise EngineIncompatible(f"{engine.node_id} at {engine.url} serves no /version: not vLLM", engine.node_id)
        _raise_for(engine, "/version", response)
        version = vllm_protocol.vllm_version(engine, _json(response))
        response = await self._request(engine, "GET", "/get_world_size", None, timeout)
        if response.status == 404:
            raise vllm_protocol.dev_mode_off(engine, "/get_world_size")
        _raise_for(engine, "/get_world_size", response)
        info = vllm_protocol.vllm_engine_info(engine, version, _json(response))
        bound = max(timeout, vllm_protocol.SERVER_INFO_TIMEOUT_SECONDS)  # its first answer is slow, then cached
        response = await self._request(engine, "GET", vllm_protocol.SERVER_INFO_PATH, None, bound)
        _raise_for(engine, "/server_info", response)
        vllm_protocol.check_backend(engine, _json(response), colocated)
        return info

    async def post(self, engine: EngineEndpoint, path: str, body: dict[str, Any], timeout: float | None = None) -> str:
        """POST `body`; returns SGLang's `message`. Any non-2xx answer or `success: false` raises."""
        response = await self._request(engine, "POST", path, body, timeout)
        _raise_for(engine, path, response)
        answer = _json(response)
        if answer.get("success") is False:
            raise WeightSyncError(f"{engine.node_id} refused {path}: {answer.get('message', '')}", engine.node_id)
        return str(answer.get("message", ""))

    async def weight_version(self, engine: EngineEndpoint, timeout: float) -> int:
        """The engine's published version from `/model_info` (vLLM: `/weight_info`); 0 where it is not an integer
        (SGLang's and vLLM's initial `"default"`, or a name an operator set)."""
        path = "/weight_info" if engine.kind == "vllm" else "/model_info"
        try:
            response = await self._request(engine, "GET", path, None, timeout)
            value = _json(response).get("weight_version")
            if isinstance(value, str) and len(value) > 20:  # no int() of thousands of digits
                return 0
            version = int(value)  # type: ignore[arg-type]
        except (WeightSyncError, TypeError, ValueError):
            return 0
        return version if 0 <= version <= MAX_WEIGHT_VERSION else 0

    async def alive(self, engine: EngineEndpoint, timeout: float) -> bool:
        """Whether GET /health answers at all (any status: SGLang's may run a generation and fail meanwhile)."""
        try:
            await self._http.request("GET", f"{engine.url}/health", timeout)
        except EngineHTTPError:
            return False
        return True

    async def _request(
        self, engine: EngineEndpoint, method: str, path: str, body: dict[str, Any] | None, timeout: float | None
    ) -> Answer:
        url, limit = f"{engine.url}{path}", self._timeout if timeout is None else timeout
        try:
            if engine.url in self._after_error:
                self._after_error.discard(engine.url)
                fresh = EngineHTTP(self._headers, keep_alive=False)
                try:
                    answer = await fresh.request(method, url, limit, body)
                finally:
                    await fresh.aclose()
            else:
                answer = await self._http.request(method, url, limit, body)
            if engine.kind == "vllm" and answer.status >= 500:
                self._after_error.add(engine.url)
            return answer
        except EngineHTTPError as exc:
            raise WeightSyncError(
                f"rollout engine {engine.node_id} at {engine.url} failed {method} {path}: {exc!r}", engine.node_id
            ) from exc


def _json(response: Answer) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _raise_for(engine: EngineEndpoint, path: str, response: Answer) -> None:
    node = engine.node_id
    if response.status in (401, 403):
        raise EngineAuthRefused(
            f"{node} at {engine.url} refused DCS's API key on {path} ({response.status}): start the engine "
            "with --api-key equal to DCS_AUTH_TOKEN (or set DCS_AUTH_TOKEN to its key)",
            node,
        )
    if response.is_success:
        return
    if engine.kind == "vllm" and response.status == 404:
        raise vllm_protocol.dev_mode_off(engine, path.split("?")[0])
    body = _json(response)
    reason = body.get("message") or body.get("detail") or body.get("error") or response.text[:500]
    raise WeightSyncError(f"rollout engine {node} refused {path} ({response.status}): {reason}", node)


async def all_or_first_error(*calls: Any) -> list[Any]:
    """Run per-engine calls concurrently; the first failure cancels the others and is raised at once (an
    engine refusing a bucket must not leave the trainer waiting on a broadcast nobody receives)."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
