"""Heartbeat loops of registered nodes: each beats through a `CoordinatorAPI` from one background asyncio task.

`HeartbeatLoop` beats for one node (`POST /heartbeat`), `FleetHeartbeatLoop` for many at once (`POST /heartbeats`,
a host agent's nodes). Both are fenced by the identity the node registered with: a node whose rank another now
holds stops and is reported in `lost`; a node the coordinator forgot is registered again with its rank;
transient failures are logged, counted and retried at the next beat. Kept apart from the HTTP client, which
needs no loop.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Self

from dcs_tasks.aiotask import cancel_and_wait
from dcs_tasks.config import RoleInfo
from dcs_tasks.coordinator_api import CoordinatorAPI
from dcs_tasks.errors import ClientClosed, CoordinatorError, NodeNotFound, RankConflict
from dcs_tasks.models import BeatOutcome

log = logging.getLogger(__name__)


class _BackgroundLoop:
    """A loop run as one background asyncio task: `start()` (idempotent) and `stop()` (cancels and waits)."""

    _task: asyncio.Task[None] | None = None

    def _task_name(self) -> str:
        raise NotImplementedError

    async def _run(self) -> None:
        raise NotImplementedError

    def start(self) -> Self:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=self._task_name())
        return self

    @property
    def running(self) -> bool:
        """Started, and neither stopped nor ended by itself (a lost rank, a closed client)."""
        return self._task is not None and not self._task.done()

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            await cancel_and_wait(task)


class HeartbeatLoop(_BackgroundLoop):
    """Beats for one node every `interval` seconds in a background asyncio task until `stop()`.

    Beats are fenced (see `CoordinatorAPI.heartbeat`: the identity from registering through the same `api`,
    else the node's ip:port): if the node was presumed dead and its rank given to a replacement, the beat
    fails with RankConflict; the loop then stops and keeps the error in `lost` (the node must re-register
    and rebuild what it built on its old rank). A beat
    the coordinator cannot answer (it or Redis down) is retried by `api` for up to its `retry_for_s`, then
    logged and beaten again at the next interval. When the coordinator no
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

    def _task_name(self) -> str:
        return f"dcs-heartbeat-{self.info.node_id}"

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
            except ClientClosed:  # its owner closed the client without stopping the loop first
                log.info("heartbeats of %s stopped: the coordinator client was closed", self.info.node_id)
                return
            except CoordinatorError as exc:
                self.failures += 1
                log.warning("heartbeat of %s failed (will retry): %s", self.info.node_id, exc)
            await asyncio.sleep(self.interval)


class FleetHeartbeatLoop(_BackgroundLoop):
    """Beats for many registered nodes every `interval` seconds from one background task, with one
    `POST /heartbeats` per 2,048 nodes instead of one request per node (a host agent holding many nodes).

    Like `HeartbeatLoop` per node: a node the coordinator no longer knows (`not_found`) is re-registered with
    its rank (`register_many`); a node whose rank another node now holds (`conflict`) leaves the loop and is
    listed in `lost` (it must re-register and rebuild what it built on its old rank); transient failures are
    logged, counted in `failures` and retried at the next beat.
    """

    def __init__(self, api: CoordinatorAPI, infos: list[RoleInfo], interval: float) -> None:
        if any(info.rank is None for info in infos):
            raise ValueError("FleetHeartbeatLoop needs registered nodes with ranks")
        self.api = api
        self.nodes: dict[tuple[str, int], RoleInfo] = {(i.role_name, i.rank or 0): i for i in infos}
        self.interval = interval
        self.beats = 0  # node beats recorded
        self.failures = 0
        self.lost: list[str] = []  # node ids fenced out
        self._task: asyncio.Task[None] | None = None

    def _task_name(self) -> str:
        return "dcs-fleet-heartbeat"

    async def beat_once(self) -> None:
        """One beat of every node; re-registers the unknown ones, drops the fenced-out ones."""
        order = list(self.nodes)
        outcomes = await self.api.heartbeat_many(order)
        missing = [self.nodes[n] for n, o in zip(order, outcomes, strict=True) if o is BeatOutcome.NOT_FOUND]
        for node, outcome in zip(order, outcomes, strict=True):
            if outcome is BeatOutcome.CONFLICT:
                info = self.nodes.pop(node)
                self.lost.append(info.node_id)
                log.error("%s lost its rank to another node, heartbeats stopped for it", info.node_id)
        self.beats += sum(o is BeatOutcome.OK for o in outcomes)
        if missing:
            await self.api.register_many(missing)
            self.beats += len(missing)

    async def _run(self) -> None:
        while self.nodes:
            try:
                await self.beat_once()
            except ClientClosed:
                log.info("fleet heartbeats stopped: the coordinator client was closed")
                return
            except CoordinatorError as exc:
                self.failures += 1
                log.warning("fleet heartbeat of %d nodes failed (will retry): %s", len(self.nodes), exc)
            await asyncio.sleep(self.interval)
