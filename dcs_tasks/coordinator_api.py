"""Async HTTP client of the coordinator: one typed method per endpoint.

Errors map onto the DCS tree: 404 -> `NodeNotFound`, 401 -> `AuthError`, 409 -> `RankConflict`, 502, 503,
504 and transport failures (refused, reset, timed out) -> `CoordinatorUnavailable`, any other non-2xx or an
answer that does not parse as the endpoint's model -> `CoordinatorError`. Every call
is bounded by `timeout` seconds; a long-poll adds its own `wait_timeout_s` on top.

Retries (for coordinator replicas behind a load balancer, a Redis failover): a call that is safe to repeat
is retried on `CoordinatorUnavailable` with a jittered exponential backoff for up to `retry_for_s` seconds
(plus the one attempt in flight then): every GET (heartbeat, topology, node, peer, health, weight-meta reads;
a long-poll is re-issued from the same index with the wait it has left), `register` when its answer cannot
change on a repeat (an explicit rank, or a port: the same ip:port keeps its rank), and `send_weight_meta`,
which sends one `Idempotency-Key` for all its attempts so the coordinator appends the entry once (retried
for at most `IDEMPOTENCY_WINDOW_S`: the coordinator keeps the key 60 s). Not
retried: `register` without rank and port (each attempt would take a new rank), `unregister` and
`clear_weight_meta` (a repeat would remove another node or entries appended meanwhile).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from dcs_tasks.backoff import backoff_delay
from dcs_tasks.config import RoleInfo
from dcs_tasks.errors import (
    AuthError,
    ClientClosed,
    CoordinatorError,
    CoordinatorUnavailable,
    NodeNotFound,
    RankConflict,
)
from dcs_tasks.models import (
    MAX_BATCH_NODES,
    BeatOutcome,
    ClearWeightMetaResponse,
    DebugTopologyResponse,
    GlobalRankResponse,
    GroupRanksResponse,
    HealthResponse,
    HeartbeatBatchRequest,
    HeartbeatBatchResponse,
    HeartbeatResponse,
    NodeBeat,
    RegisterBatchRequest,
    RegisterBatchResponse,
    RegisterRequest,
    RegisterResponse,
    StatusResponse,
    TopologyResponse,
    WeightMeta,
    WeightMetaBatch,
)

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)
KEEPALIVE_EXPIRY_S = 15.0
RETRY_BASE_S = 0.05  # first retry after CoordinatorUnavailable waits ~0.05-0.1 s (equal jitter) ...
RETRY_CAP_S = 1.0  # ... doubling up to 0.5-1 s

IDEMPOTENCY_HEADER = "Idempotency-Key"
# The coordinator remembers an append's key for 60 s (coordinator/weight_meta.py APPEND_MARKER_TTL_MS): an
# append is retried for at most this long, whatever `retry_for_s` says, so a repeat always finds its key.
IDEMPOTENCY_WINDOW_S = 50.0
UNAVAILABLE_STATUSES = frozenset({502, 503, 504})  # a load balancer without a live coordinator, or no Redis


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
    if code in UNAVAILABLE_STATUSES:
        raise CoordinatorUnavailable(message, code)
    raise CoordinatorError(message, code)


class CoordinatorAPI:
    """Client of one coordinator (or a load balancer in front of several) at `base_url`. Use as
    `async with CoordinatorAPI(...) as api:` or call `aclose()`."""

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        timeout: float = 30.0,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        retry_for_s: float = 10.0,
    ) -> None:
        """`transport` replaces the network (e.g. `httpx.ASGITransport(app)` to call an app in-process).
        `retry_for_s`: how long a repeatable call keeps retrying while the coordinator is unavailable (0: never).
        """
        if retry_for_s < 0:
            raise ValueError(f"retry_for_s must be >= 0 seconds, got {retry_for_s}")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.retry_for_s = retry_for_s
        self.retries = 0  # attempts repeated after CoordinatorUnavailable, over this client's life
        # idle connections are kept longer than the 5 s heartbeat interval (and shorter than the coordinator's
        # DCS_COORDINATOR_KEEP_ALIVE_SECONDS): each beat reuses its connection instead of a new TCP handshake
        limits = httpx.Limits(max_keepalive_connections=20, keepalive_expiry=KEEPALIVE_EXPIRY_S)
        self._http = httpx.AsyncClient(
            base_url=self.base_url, headers=headers, timeout=timeout, transport=transport, limits=limits
        )
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
        retry: bool = False,
        retry_within: float | None = None,
    ) -> M:
        """One request; with `retry`, repeated while the coordinator is unavailable (see `_retrying`)."""

        def attempt() -> Awaitable[M]:
            return self._call_once(method, path, model, params, body, timeout, headers)

        return await (self._retrying(attempt, f"{method} {path}", retry_within) if retry else attempt())

    async def _retrying(self, attempt: Callable[[], Awaitable[M]], what: str, within: float | None = None) -> M:
        """`attempt()` until it does not raise CoordinatorUnavailable, for up to `retry_for_s` seconds (and at
        most `within`)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.retry_for_s if within is None else min(self.retry_for_s, within))
        failures = 0
        while True:
            try:
                return await attempt()
            except CoordinatorUnavailable as exc:
                left = deadline - loop.time()
                if left <= 0:
                    raise
                failures += 1
                self.retries += 1
                delay = min(backoff_delay(failures, RETRY_BASE_S, RETRY_CAP_S, "equal"), left)
                log.info("%s at %s: %s; retry %d in %.2fs", what, self.base_url, exc, failures, delay)
                await asyncio.sleep(delay)

    async def _call_once(
        self,
        method: str,
        path: str,
        model: type[M],
        params: dict[str, Any] | None,
        body: BaseModel | None,
        timeout: float | None,
        headers: dict[str, str] | None,
    ) -> M:
        if self._http.is_closed:  # httpx would raise a bare RuntimeError
            raise ClientClosed(f"{method} {path}: this client of {self.base_url} was closed")
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
    async def register(self, info: RoleInfo, wait_for_rank_s: float = 0.0) -> RegisterResponse:
        """Register `info`; `rank=None` gets the smallest free rank; re-registering the same node keeps its rank.

        Remembers the answer's fencing `identity`, which `heartbeat` then sends for that (role, rank).
        Retried while the coordinator is unavailable when a repeat gets the same rank: `info` has a rank or a
        port (ip:port is the node's identity). Without either every attempt would take a new rank: not retried.
        `wait_for_rank_s`: an explicit rank still held by a live node of another identity (RankConflict: e.g.
        this process's own predecessor, killed, until its heartbeat TTL runs out) is asked for again every
        second for up to this long before RankConflict is raised.
        """
        body = RegisterRequest.model_validate(info.model_dump())
        repeatable = info.rank is not None or bool(info.port)
        deadline = time.monotonic() + wait_for_rank_s
        while True:
            try:
                answer = await self._call("POST", "/register", RegisterResponse, body=body, retry=repeatable)
                break
            except RankConflict:
                left = deadline - time.monotonic()
                if info.rank is None or left <= 0:
                    raise
                await asyncio.sleep(min(1.0, left))
        if answer.identity:
            self._identities[(info.role_name, answer.rank)] = answer.identity
        return answer

    def remember_identity(self, role: str, rank: int, identity: str) -> None:
        """Fence this client's later calls for (role, rank) with `identity` (a registration made elsewhere: the
        host agent registered the node, or the node's own process did and the agent beats it)."""
        if identity:
            self._identities[(role, rank)] = identity

    def forget_identity(self, role: str, rank: int) -> None:
        self._identities.pop((role, rank), None)

    def identity_of(self, role: str, rank: int) -> str:
        """The fencing identity this client holds for (role, rank), or ""."""
        return self._identities.get((role, rank), "")

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
        self, role: str, rank: int, *, ip: str | None = None, port: int | None = None, identity: str | None = None
    ) -> HeartbeatResponse:
        """Refresh the node's liveness; NodeNotFound when (role, rank) is not registered.

        The beat is fenced (header `X-DCS-Node`; RankConflict when another node now holds the rank) with
        `identity` when given (a host agent checking an identity a process claims), else `ip:port` when both
        are given (a node's identity when it has a port), else with the identity this client's `register` got
        for (role, rank). Only a portless node registered by another client beats unfenced.
        """
        params = {"role": role, "rank": rank}
        if not identity:
            identity = f"{ip}:{port}" if ip and port else self._identities.get((role, rank))
        headers = {"X-DCS-Node": identity} if identity else None
        return await self._call("GET", "/heartbeat", HeartbeatResponse, params=params, headers=headers, retry=True)

    async def heartbeat_many(self, nodes: list[tuple[str, int]]) -> list[BeatOutcome]:
        """Beat many nodes with one `POST /heartbeats` per MAX_BATCH_NODES: for one process holding many nodes
        (a host agent). Each beat is fenced with the identity this client's `register`/`register_many` got for
        it. Returns one outcome per node, in order (`ok`, `not_found`, `conflict`); no exception for those."""
        outcomes: list[BeatOutcome] = []
        for start in range(0, len(nodes), MAX_BATCH_NODES):
            beats = [
                NodeBeat(role=role, rank=rank, identity=self._identities.get((role, rank), ""))
                for role, rank in nodes[start : start + MAX_BATCH_NODES]
            ]
            body = HeartbeatBatchRequest(beats=beats)
            answer = await self._call("POST", "/heartbeats", HeartbeatBatchResponse, body=body, retry=True)
            outcomes += answer.results
        return outcomes

    async def register_many(self, infos: list[RoleInfo]) -> list[RegisterResponse]:
        """`register` for each of `infos` with one `POST /register_batch` per MAX_BATCH_NODES (in order; each
        registration is atomic on its own). Remembers each answer's identity for `heartbeat_many`."""
        answers: list[RegisterResponse] = []
        for start in range(0, len(infos), MAX_BATCH_NODES):
            chunk = infos[start : start + MAX_BATCH_NODES]
            body = RegisterBatchRequest(nodes=[RegisterRequest.model_validate(i.model_dump()) for i in chunk])
            repeatable = all(info.rank is not None or info.port for info in chunk)  # as `register`
            batch = await self._call("POST", "/register_batch", RegisterBatchResponse, body=body, retry=repeatable)
            for info, answer in zip(chunk, batch.nodes, strict=True):
                if answer.identity:
                    self._identities[(info.role_name, answer.rank)] = answer.identity
            answers += batch.nodes
        return answers

    async def node(self, role: str, rank: int) -> RoleInfo:
        return await self._call("GET", "/node", RoleInfo, params={"role": role, "rank": rank}, retry=True)

    async def peer(self, role: str, rank: int, peer_role: str | None = None) -> RoleInfo:
        """The live node of the same rank in `peer_role` (default: the configured mapping of `role`)."""
        params: dict[str, Any] = {"role": role, "rank": rank}
        if peer_role is not None:
            params["peer_role"] = peer_role
        return await self._call("GET", "/peer", RoleInfo, params=params, retry=True)

    # --- topology -------------------------------------------------------------------------------
    async def topology(self, role_filter: str | None = None) -> TopologyResponse:
        params = {"role_filter": role_filter} if role_filter is not None else None
        return await self._call("GET", "/topology", TopologyResponse, params=params, retry=True)

    async def global_rank(self, role: str, rank: int) -> int:
        params = {"role": role, "rank": rank}
        answer = await self._call("GET", "/global_rank", GlobalRankResponse, params=params, retry=True)
        return answer.global_rank

    async def model_update_group_ranks(self, role: str, rank: int, need_update_ref: bool = False) -> GroupRanksResponse:
        params = {"role": role, "rank": rank, "need_update_ref": need_update_ref}
        return await self._call("GET", "/get_model_update_group_ranks", GroupRanksResponse, params=params, retry=True)

    async def health(self) -> HealthResponse:
        """The coordinator's and Redis's health as answered now (a probe: not retried)."""
        return await self._call("GET", "/health", HealthResponse)

    async def debug_topology(self) -> DebugTopologyResponse:
        return await self._call("GET", "/debug/topology", DebugTopologyResponse, retry=True)

    async def healthz(self) -> StatusResponse:
        """Liveness of the coordinator process itself (no Redis round trip, no token needed; not retried)."""
        return await self._call("GET", "/healthz", StatusResponse)

    # --- weight meta ----------------------------------------------------------------------------
    async def send_weight_meta(self, meta: WeightMeta) -> StatusResponse:
        """Append `meta` to the log. All attempts carry one `Idempotency-Key`: the entry is appended once even
        when an attempt's answer was lost (its coordinator died after appending) and another attempt repeats it.
        """
        headers = {IDEMPOTENCY_HEADER: uuid.uuid4().hex}
        return await self._call(
            "POST",
            "/send_weight_meta",
            StatusResponse,
            body=meta,
            headers=headers,
            retry=True,
            retry_within=IDEMPOTENCY_WINDOW_S,
        )

    async def recv_weight_meta(
        self, index: int = 0, wait_timeout_s: float = 0.0, limit: int | None = None
    ) -> WeightMetaBatch:
        """Entries from `index` on; waits up to `wait_timeout_s` for one to arrive (empty batch on timeout).

        One answer is capped (entries, bytes; at most `limit` entries when given): when `batch.more`, more
        entries are already in the log, so continue from `batch.next_index` (`recv_weight_meta_all` does).
        A wait cut by the coordinator's death is re-issued from the same `index` with the wait it has left.
        """
        loop = asyncio.get_running_loop()
        wait_until = loop.time() + wait_timeout_s

        def attempt() -> Awaitable[WeightMetaBatch]:
            wait = max(0.0, wait_until - loop.time())
            params: dict[str, Any] = {"index": index, "wait_timeout_s": wait}
            if limit is not None:
                params["limit"] = limit
            return self._call_once("GET", "/recv_weight_meta", WeightMetaBatch, params, None, self.timeout + wait, None)

        return await self._retrying(attempt, "GET /recv_weight_meta")

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
