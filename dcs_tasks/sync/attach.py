"""`dcs engine attach`: a sidecar that puts one SGLang server into the DCS topology and keeps it there.

Cycle: wait (bounded) for the engine's `/health` -> read its server info once and refuse what DCS cannot
push weights to -> register it as `rollout` rank N with its advertised address and tp span -> every
heartbeat interval probe `/health` and beat while it answers (see `AttachSettings` for how long a failing
`/health` is tolerated) -> once the engine is down, unregister and start over (a restarted engine is read
again and re-registered). An engine that answers again after a probe it did not answer at all (refused,
reset, timed out) is read again and registered anew at once, with a new `instance` token in its metadata:
it may be a restarted process, which trainers must not take for the member of their formed group.
Cancelling `run` (SIGTERM/SIGINT in the CLI) unregisters the engine. No key is ever logged.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from dataclasses import dataclass
from typing import Any

from dcs_tasks.config import DCSConfig, RoleInfo
from dcs_tasks.coordinator_api import CoordinatorAPI
from dcs_tasks.errors import (
    CoordinatorError,
    CoordinatorUnavailable,
    DCSTimeoutError,
    EngineAuthRefused,
    EngineIncompatible,
    RankConflict,
    WeightSyncError,
)
from dcs_tasks.heartbeats import HeartbeatLoop
from dcs_tasks.hostagent import NodeLiveness
from dcs_tasks.models import RegisterResponse
from dcs_tasks.sync.engine_probe import EngineProbe
from dcs_tasks.sync.planning import new_instance
from dcs_tasks.sync.wire import EngineInfo

log = logging.getLogger(__name__)


def engine_metadata(info: EngineInfo) -> dict[str, Any]:
    """Topology metadata of an attached engine, for operators: the trainer reads none of it (it asks the
    engine's `/server_info` itself, dcs_tasks/sync/planning.py); `num_gpus` is the engine's rank span."""
    # "engine" is the one key the trainer reads: it picks the protocol (SGLang's or vLLM's RL API)
    return {"engine": info.kind, "engine_version": info.version, "tp_size": info.tp_size, "num_gpus": info.tp_size}


@dataclass(frozen=True)
class AttachSettings:
    """Everything one attachment needs; times in seconds."""

    rank: int
    advertise_ip: str
    advertise_port: int
    role: str = "rollout"
    interval: float = 5.0
    """Probe-and-beat period (the coordinator's heartbeat interval)."""
    down_after: float = 30.0
    """An engine whose `/health` does not answer at all (refused, reset, timed out) gets no heartbeats, and is
    unregistered once that has lasted this long."""
    unhealthy_after: float = 600.0
    """An engine whose `/health` answers, but not 200, keeps its heartbeats for this long, then is unregistered:
    SGLang's `/health` runs a one-token generation and answers 503 when the scheduler gave no output for 20 s,
    which a weight update longer than that causes."""
    wait_timeout: float = 1800.0
    """Longest wait for the engine to (re)start answering `/health`, and for the coordinator to register it."""
    health_timeout: float = 25.0
    """Timeout of one `/health` probe (SGLang's own generation check gives up after 20 s)."""
    colocated: dict[str, Any] | None = None
    """`metadata["colocated"]`'s entry (`dcs_tasks.sync.colocated.colocation_metadata`): the engine shares its
    host and device with that trainer rank, which updates it by handle; None: a remote engine."""


class Outage(enum.Enum):
    """How `EngineAttachment.beat_while_healthy` ended."""

    DOWN = "down"  # failed /health for longer than allowed: unregister, wait for the engine
    BACK = "back"  # answered again after not answering at all: register anew


class EngineAttachment:
    """Keeps the engine behind `engine` registered in the coordinator behind `api` while it is healthy."""

    def __init__(
        self, api: CoordinatorAPI, engine: EngineProbe, settings: AttachSettings, config: DCSConfig | None = None
    ) -> None:
        """`config`: register and beat through the host's agent (`dcs worker`) when one answers
        (dcs_tasks/hostagent.py); without it, or without an agent, the attachment beats per node itself."""
        self.api = api
        self.engine = engine
        self.settings = settings
        self.config = config
        self._liveness: NodeLiveness | None = None
        self.registered: RoleInfo | None = None
        self.registrations = 0

    async def run(self) -> None:
        """Attach, and re-attach after every engine outage, until cancelled (then unregister) or an error."""
        try:
            while True:
                await self.attach_once()
                while await self.beat_while_healthy() is Outage.BACK:
                    log.info("engine answers again after not answering: registering it anew (it may have restarted)")
                    await self.attach_once()
                await self.unregister()
        finally:
            await self.unregister()

    async def attach_once(self) -> RoleInfo:
        """Wait for the engine, read and check its server info, register it; returns the registered node."""
        s = self.settings
        info = await self._read_engine()
        # a new instance token per registration: trainers rebuild their group for a restarted engine
        metadata = engine_metadata(info) | {"instance": new_instance()} | (s.colocated or {})
        node = RoleInfo(role_name=s.role, rank=s.rank, ip=s.advertise_ip, port=s.advertise_port, metadata=metadata)
        answer = await self._register(node)
        self.registered = node.model_copy(update={"rank": answer.rank})
        self.registrations += 1
        log.info(
            "registered %s %s engine %s as %s at %s (tp_size %d: %d ranks of the update group)",
            "vLLM" if info.kind == "vllm" else "SGLang",
            info.version,
            self.engine.base_url,
            answer.node_id,
            node.address,
            info.tp_size,
            info.tp_size,
        )
        return self.registered

    async def _read_engine(self) -> EngineInfo:
        """Wait (bounded) for `/health`, then read the server info; a refused engine raises at once."""
        s = self.settings
        deadline = time.monotonic() + s.wait_timeout
        log.info("waiting up to %gs for engine %s to answer GET /health", s.wait_timeout, self.engine.base_url)
        while True:
            left = max(0.0, deadline - time.monotonic())
            await self.engine.wait_healthy(left, poll=min(s.interval, 1.0), health_timeout=s.health_timeout)
            try:
                return await self.engine.server_info()
            except (EngineIncompatible, EngineAuthRefused):
                raise
            except WeightSyncError as exc:  # gone again, or busy: wait for /health once more
                if time.monotonic() >= deadline:
                    raise
                log.warning("reading the engine's server info failed (will retry): %s", exc)
                await asyncio.sleep(s.interval)

    async def _register(self, node: RoleInfo) -> RegisterResponse:
        """Register, retrying while the coordinator is unavailable (bounded by `wait_timeout`)."""
        deadline = time.monotonic() + self.settings.wait_timeout
        while True:
            try:
                if self.config is None:
                    return await self.api.register(node)
                # beats follow the engine's probes, one per interval: the lease lasts two of them
                config = self.config.model_copy(update={"heartbeat_interval_seconds": self.settings.interval})
                liveness = NodeLiveness(self.api, config, node, lease_s=2 * self.settings.interval + 1)
                answer = await liveness.register()
                self._liveness = liveness
                return answer
            except CoordinatorUnavailable as exc:
                if time.monotonic() >= deadline:
                    raise DCSTimeoutError(
                        f"coordinator at {self.api.base_url} unavailable for {self.settings.wait_timeout:g}s: {exc}"
                    ) from exc
                log.warning("registering failed, coordinator unavailable (will retry): %s", exc)
                await asyncio.sleep(self.settings.interval)

    async def beat_while_healthy(self) -> Outage:
        """Beat every interval while the engine is up. Returns DOWN once it has been down too long (see
        `AttachSettings`), BACK once it answers again after a probe it did not answer at all (the engine process
        may have been replaced: it must be registered anew)."""
        assert self.registered is not None
        s = self.settings
        beats = self._liveness or HeartbeatLoop(self.api, self.registered, s.interval)
        failing_since: float | None = None  # first probe of the current run without a 200
        unanswered = False  # a probe of the current run got no answer at all
        while True:
            started = time.monotonic()
            probe = await self.engine.health(s.health_timeout)
            if probe.ok:
                if unanswered:
                    return Outage.BACK
                if failing_since is not None:
                    log.info("engine answers /health with 200 again")
                failing_since = None
            elif failing_since is None:
                failing_since = started
                effect = "heartbeats go on" if probe.answered else "heartbeats paused"
                log.warning("engine's /health failed (%s): %s", probe.reason, effect)
            unanswered = unanswered or not probe.answered
            if failing_since is not None:
                limit = s.unhealthy_after if probe.answered else s.down_after
                if time.monotonic() - failing_since >= limit:
                    log.warning("engine's /health has failed for %gs (last: %s): unregistering", limit, probe.reason)
                    return Outage.DOWN
            if probe.answered:
                await self._beat(beats)
            await asyncio.sleep(max(0.0, s.interval - (time.monotonic() - started)))

    async def _beat(self, beats: HeartbeatLoop | NodeLiveness) -> None:
        """One beat; transient coordinator failures are logged, RankConflict (rank taken over) propagates."""
        try:
            await beats.beat_once()
        except RankConflict:
            self.registered = None  # the rank is another node's now: nothing of ours to unregister
            raise
        except CoordinatorError as exc:
            log.warning("heartbeat failed (will retry): %s", exc)

    async def unregister(self) -> None:
        """Remove the registered node, if any (best effort: the coordinator expires it anyway)."""
        node, self.registered = self.registered, None
        liveness, self._liveness = self._liveness, None
        if liveness is not None:
            await liveness.stop()  # the agent stops beating it before it is removed
        if node is None or node.rank is None:
            return
        try:
            await self.api.unregister(node.role_name, node.rank)
            log.info("unregistered %s", node.node_id)
        except CoordinatorError as exc:
            log.warning("unregistering %s failed (its heartbeat will expire): %s", node.node_id, exc)
