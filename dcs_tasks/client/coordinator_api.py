"""Async HTTP client of the coordinator: one typed method per endpoint.

Errors map onto the DCS tree: 404 -> `NodeNotFound`, 401 -> `AuthError`, 409 -> `RankConflict`, 503 and
transport failures (refused, reset, timed out) -> `CoordinatorUnavailable`, any other non-2xx or an answer
that does not parse as the endpoint's model -> `CoordinatorError`. Every call
is bounded by `timeout` seconds; a long-poll adds its own `wait_timeout_s` on top.
"""

from __future__ import annotations

import asyncio
import logging
from types import TracebackType
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from dcs_tasks.config import RoleInfo
from dcs_tasks.errors import AuthError, CoordinatorError, CoordinatorUnavailable, NodeNotFound, RankConflict
from dcs_tasks.models import (
    ClearWeightMetaResponse,
    DebugTopologyResponse,
    GlobalRankResponse,
    GroupRanksResponse,
    HealthResponse,
    HeartbeatResponse,
    RegisterRequest,
    RegisterResponse,
    StatusResponse,
    TopologyResponse,
    WeightMeta,
    WeightMetaBatch,
)

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)


def _raise_for_status(response: httpx.Response) -> None:
    if response.is_success:
        return
    try:
        detail = str(response.json().get("detail", response.text))
    except ValueError:
        detail = response.text
    where = f"{response.request.method} {response.request.url.path}"
    message = f"coordinator answered {response.status_code} to {where}: {detail}"
    code = response.status_code
    if code == 404:
        raise NodeNotFound(message, code)
    if code == 401:
        raise AuthError(message, code)
    if code == 409:
        raise RankConflict(message, code)
    if code == 503:
        raise CoordinatorUnavailable(message, code)
    raise CoordinatorError(message, code)


class CoordinatorAPI:
    """Client of one coordinator at `base_url`. Use as `async with CoordinatorAPI(...) as api:` or call `aclose()`."""

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        timeout: float = 30.0,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        """`transport` replaces the network (e.g. `httpx.ASGITransport(app)` to call an app in-process)."""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=timeout, transport=transport)
        self._identities: dict[tuple[str, int], str] = {}  # (role, rank) -> fencing identity from /register

    async def __aenter__(self) -> CoordinatorAPI:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _call(
        self,
        method: str,
        path: str,
        model: type[M],
        *,
        params: dict[str, Any] | None = None,
        body: BaseModel | None = None,
        timeout: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> M:
        content = body.model_dump_json().encode() if body is not None else None
        if body is not None:
            headers = {**(headers or {}), "Content-Type": "application/json"}
        try:
            response = await self._http.request(
                method, path, params=params, content=content, headers=headers, timeout=timeout or self.timeout
            )
        except httpx.TransportError as exc:
            raise CoordinatorUnavailable(
                f"coordinator at {self.base_url} unreachable for {method} {path}: {exc!r}"
            ) from exc
        except httpx.HTTPError as exc:  # decoding, redirects: not a transport failure, still typed
            raise CoordinatorError(f"{method} {path} at {self.base_url} failed: {exc!r}") from exc
        _raise_for_status(response)
        try:
            return model.model_validate_json(response.content)
        except ValidationError as exc:
            raise CoordinatorError(
                f"{method} {path} at {self.base_url} answered {response.status_code} with a body that is not a "
                f"{model.__name__} (is base_url a DCS coordinator of this version?): {exc}",
                response.status_code,
            ) from exc

    # --- nodes ----------------------------------------------------------------------------------
    async def register(self, info: RoleInfo) -> RegisterResponse:
        """Register `info`; `rank=None` gets the smallest free rank; re-registering the same node keeps its rank.

        Remembers the answer's fencing `identity`, which `heartbeat` then sends for that (role, rank).
        """
        body = RegisterRequest.model_validate(info.model_dump())
        answer = await self._call("POST", "/register", RegisterResponse, body=body)
        if answer.identity:
            self._identities[(info.role_name, answer.rank)] = answer.identity
        return answer

    async def unregister(self, role: str, rank: int) -> StatusResponse:
        """Remove (role, rank). Fenced with the identity this client's `register` got: RankConflict (nothing
        removed) when another node now holds the rank."""
        identity = self._identities.get((role, rank))
        headers = {"X-DCS-Node": identity} if identity else None
        params = {"role": role, "rank": rank}
        answer = await self._call("DELETE", "/unregister", StatusResponse, params=params, headers=headers)
        self._identities.pop((role, rank), None)
        return answer

    async def heartbeat(
        self, role: str, rank: int, *, ip: str | None = None, port: int | None = None
    ) -> HeartbeatResponse:
        """Refresh the node's liveness; NodeNotFound when (role, rank) is not registered.

        The beat is fenced (header `X-DCS-Node`; RankConflict when another node now holds the rank) with
        `ip:port` when both are given (a node's identity when it has a port), else with the identity this
        client's `register` got for (role, rank). Only a portless node registered by another client beats
        unfenced.
        """
        params = {"role": role, "rank": rank}
        identity = f"{ip}:{port}" if ip and port else self._identities.get((role, rank))
        headers = {"X-DCS-Node": identity} if identity else None
        return await self._call("GET", "/heartbeat", HeartbeatResponse, params=params, headers=headers)

    async def node(self, role: str, rank: int) -> RoleInfo:
        return await self._call("GET", "/node", RoleInfo, params={"role": role, "rank": rank})

    async def peer(self, role: str, rank: int, peer_role: str | None = None) -> RoleInfo:
        """The live node of the same rank in `peer_role` (default: the configured mapping of `role`)."""
        params: dict[str, Any] = {"role": role, "rank": rank}
        if peer_role is not None:
            params["peer_role"] = peer_role
        return await self._call("GET", "/peer", RoleInfo, params=params)

    # --- topology -------------------------------------------------------------------------------
    async def topology(self, role_filter: str | None = None) -> TopologyResponse:
        params = {"role_filter": role_filter} if role_filter is not None else None
        return await self._call("GET", "/topology", TopologyResponse, params=params)

    async def global_rank(self, role: str, rank: int) -> int:
        answer = await self._call("GET", "/global_rank", GlobalRankResponse, params={"role": role, "rank": rank})
        return answer.global_rank

    async def model_update_group_ranks(self, role: str, rank: int, need_update_ref: bool = False) -> GroupRanksResponse:
        params = {"role": role, "rank": rank, "need_update_ref": need_update_ref}
        return await self._call("GET", "/get_model_update_group_ranks", GroupRanksResponse, params=params)

    async def health(self) -> HealthResponse:
        return await self._call("GET", "/health", HealthResponse)

    async def debug_topology(self) -> DebugTopologyResponse:
        return await self._call("GET", "/debug/topology", DebugTopologyResponse)

    async def healthz(self) -> StatusResponse:
        """Liveness of the coordinator process itself (no Redis round trip, no token needed)."""
        return await self._call("GET", "/healthz", StatusResponse)

    # --- weight meta ----------------------------------------------------------------------------
    async def send_weight_meta(self, meta: WeightMeta) -> StatusResponse:
        return await self._call("POST", "/send_weight_meta", StatusResponse, body=meta)

    async def recv_weight_meta(
        self, index: int = 0, wait_timeout_s: float = 0.0, limit: int | None = None
    ) -> WeightMetaBatch:
        """Entries from `index` on; waits up to `wait_timeout_s` for one to arrive (empty batch on timeout).

        One answer is capped (entries, bytes; at most `limit` entries when given): when `batch.more`, more
        entries are already in the log, so continue from `batch.next_index` (`recv_weight_meta_all` does).
        """
        params: dict[str, Any] = {"index": index, "wait_timeout_s": wait_timeout_s}
        if limit is not None:
            params["limit"] = limit
        return await self._call(
            "GET", "/recv_weight_meta", WeightMetaBatch, params=params, timeout=self.timeout + wait_timeout_s
        )

    async def recv_weight_meta_all(self, index: int = 0, wait_timeout_s: float = 0.0) -> WeightMetaBatch:
        """Every entry from `index` to the log's end as one batch, following `next_index` across capped answers
        (waits like `recv_weight_meta` only for the first). Stops early if entries were dropped from the log
        between two answers (then `more` is still true). For a bounded log; a long-lived reader should process
        each `recv_weight_meta` answer instead of holding the whole log (as `ActorFwdReceiver` does)."""
        batch = await self.recv_weight_meta(index, wait_timeout_s)
        first, entries = batch.first_index, list(batch.entries)
        while batch.more and batch.entries:
            following = await self.recv_weight_meta(batch.next_index)
            if following.first_index != batch.next_index:  # trimmed or cleared in between: not contiguous
                break
            batch = following
            entries.extend(batch.entries)
        return WeightMetaBatch(
            entries=entries, next_index=batch.next_index, first_index=first, end_index=batch.end_index
        )

    async def weight_meta_end(self) -> int:
        """The absolute index one past the log's last entry (where a new reader starts), without reading entries."""
        return (await self.recv_weight_meta(0, limit=0)).end_index

    async def clear_weight_meta(self) -> ClearWeightMetaResponse:
        """Empty the weight-meta log (POST: it changes state)."""
        return await self._call("POST", "/clear_weight_meta", ClearWeightMetaResponse)


class HeartbeatLoop:
    """Beats for one node every `interval` seconds in a background asyncio task until `stop()`.

    Beats are fenced (see `CoordinatorAPI.heartbeat`: the identity from registering through the same `api`,
    else the node's ip:port): if the node was presumed dead and its rank given to a replacement, the beat
    fails with RankConflict; the loop then stops and keeps the error in `lost` (the node must re-register
    and rebuild what it built on its old rank). Transient
    failures (coordinator or Redis down) are logged and retried at the next beat. When the coordinator no
    longer knows the node (404: unregistered by an operator, or a flushed Redis) the loop re-registers
    `info` with the rank it had.
    """

    def __init__(self, api: CoordinatorAPI, info: RoleInfo, interval: float) -> None:
        if info.rank is None:
            raise ValueError("HeartbeatLoop needs a registered node with a rank")
        self.api = api
        self.info = info
        self.interval = interval
        self.beats = 0
        self.failures = 0
        self.lost: RankConflict | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> HeartbeatLoop:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"dcs-heartbeat-{self.info.node_id}")
        return self

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def beat_once(self) -> None:
        """One beat; raises RankConflict when the rank now belongs to another node."""
        assert self.info.rank is not None
        try:
            await self.api.heartbeat(self.info.role_name, self.info.rank, ip=self.info.ip, port=self.info.port)
        except NodeNotFound:
            await self.api.register(self.info)
        self.beats += 1

    async def _run(self) -> None:
        while True:
            try:
                await self.beat_once()
            except RankConflict as exc:
                self.lost = exc
                log.error("%s lost its rank, heartbeats stopped: %s", self.info.node_id, exc)
                return
            except CoordinatorError as exc:
                self.failures += 1
                log.warning("heartbeat of %s failed (will retry): %s", self.info.node_id, exc)
            await asyncio.sleep(self.interval)
