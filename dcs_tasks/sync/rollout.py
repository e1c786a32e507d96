"""Actor -> rollout weight updates over SGLang's weight-update HTTP API (no DCS extension on the wire).

Per update: live rollout nodes from the coordinator -> reuse the group if the engines (rank, ip, port and
registration instance: `dcs_tasks.sync.planning`) are unchanged, else read every engine's `/server_info`
(version, tp_size; `engine_protocol`), plan rank spans and form a new group -> pause generation (`retract`;
`abort` on 0.5.20) -> `/begin_weight_update` where the version needs a session -> per bucket, POST
/update_weights_from_distributed to every engine while the bucket is broadcast (SGLang's `flattened_bucket`
layout; the last bucket names the version and flushes the cache) -> `/end_weight_update` ->
`/continue_generation`. `weight_version` rises by one per successful update, starting above every engine's
published version when a group forms (so a restarted trainer never goes back). With a group to reuse, the
topology read, pause + begin and the packing of the first bucket run at once; nothing is sent before the
topology confirmed the engines and every session is open (engines that changed: the sessions just opened on
those still listed are closed, the group is rebuilt).

A failure drops the group (the next update rebuilds it over the nodes then alive), ends every session this
update opened (no engine is left mid-session) and resumes generation on engines that were sent no bucket.
SGLang loads each bucket into its live weights and has no rollback, so engines that were sent a bucket stay
paused: they hold a partial update until the next update completes (or an operator resumes them). It
raises `WeightSyncError` (or its subclass) naming the engine when one is to blame.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from dcs_tasks.backends.fusion import FusionLayout
from dcs_tasks.backoff import backoff_delay
from dcs_tasks.coordinator_api import CoordinatorAPI
from dcs_tasks.engine_http import ConnectError, EngineHTTPError, EngineTimeout
from dcs_tasks.errors import DCSError, EngineAuthRefused, EngineIncompatible, GroupInitError, WeightSyncError
from dcs_tasks.sync import vllm_protocol
from dcs_tasks.sync.bootstrap_client import ActiveGroup, GroupBootstrapper
from dcs_tasks.sync.engine_protocol import EngineAPI, all_or_first_error
from dcs_tasks.sync.planning import endpoint_of, plan_rollout_group
from dcs_tasks.sync.sender import Announce, BucketSender, RolloutDetails, UpdateReport
from dcs_tasks.sync.wire import (
    SGLANG_FLAT_FORMAT,
    EngineEndpoint,
    EngineInfo,
    QuantizationConfig,
    UpdateWeightsFromDistributedRequest,
    signature_of,
)

log = logging.getLogger(__name__)
BLAME_TIMEOUT_SECONDS = 3.0
PROBE_TIMEOUT_SECONDS = 10.0  # per /server_info or /model_info read
CLEANUP_TIMEOUT_SECONDS = 10.0  # per call, when ending sessions / resuming generation after a failure


class Marks:
    """Where one update's time went: `<event>_at` seconds after its start (the latest engine's), and summed
    `<what>_seconds`; merged into the update's metrics."""

    def __init__(self, started: float | None = None) -> None:
        self.started = time.perf_counter() if started is None else started
        self.phases: dict[str, float] = {}

    def mark(self, name: str) -> None:
        self.phases[name] = max(self.phases.get(name, 0.0), time.perf_counter() - self.started)

    def add(self, name: str, seconds: float) -> None:
        self.phases[name] = self.phases.get(name, 0.0) + seconds


class EngineSessions:
    """The engine-side frame of one update: pause, begin, (buckets), end, continue; `abandon` after a failure.

    Per engine family: SGLang `/pause_generation`, `/begin_weight_update`, `/end_weight_update`,
    `/continue_generation`; vLLM `/pause?mode=abort`, `/start_weight_update`, `/finish_weight_update` (with the
    update's `weight_version`), `/resume` (`vllm_protocol`)."""

    def __init__(
        self, api: EngineAPI, engines: tuple[EngineEndpoint, ...], marks: Marks | None = None, version: int = 0
    ) -> None:
        self.api = api
        self.engines = engines
        self.version = version
        self.marks = marks or Marks()
        self.paused: list[EngineEndpoint] = []
        self.begun: list[EngineEndpoint] = []
        self.loaded: set[str] = set()  # engines that were sent a bucket (may hold part of this update)

    async def open(self) -> None:
        """Per engine pause, then begin (SGLang's begin takes the model-update writer lock unless the engine is
        paused, i.e. would wait for running requests); engines concurrently."""
        await all_or_first_error(*(self._open_one(e) for e in self.engines))

    async def _open_one(self, engine: EngineEndpoint) -> None:
        assert engine.info is not None
        if engine.info.pause:
            self.paused.append(engine)  # before the call: a pause cancelled in flight may still have landed
            if engine.kind == "vllm":
                await self.api.post(engine, f"/pause?mode={engine.info.pause_mode}", {})
            else:
                await self.api.post(engine, "/pause_generation", {"mode": engine.info.pause_mode})
            self.marks.mark("paused_at")
        if engine.info.sessions:
            await self._begin(engine)
            self.marks.mark("begun_at")

    async def _begin(self, engine: EngineEndpoint) -> None:
        self.begun.append(engine)  # before the call: a begin cancelled in flight may still have opened one
        if engine.kind == "vllm":
            await self._start_vllm(engine)
            return
        try:
            await self.api.post(engine, "/begin_weight_update", {})
        except WeightSyncError as exc:
            if "already open" not in str(exc):
                raise
            # left open by an updater that died mid-update: close it (SGLang keeps what it loaded) and retry
            log.warning("%s had a weight-update session open; ending it first", engine.node_id)
            await self.api.post(engine, "/end_weight_update", {})
            await self.api.post(engine, "/begin_weight_update", {})

    async def _start_vllm(self, engine: EngineEndpoint) -> None:
        """vLLM's `/start_weight_update`; its workers refuse a second start while one is active (a 500 naming
        `start_weight_update called while a weight update is already active`), left by an updater that died
        mid-update: finish that one (vLLM keeps what it loaded) and start again."""
        try:
            await self.api.post(engine, "/start_weight_update", {})
        except WeightSyncError as exc:
            if isinstance(exc, EngineAuthRefused) or "already active" not in str(exc):
                raise
            log.warning("%s had a weight update active; finishing it first", engine.node_id)
            await self.api.post(engine, "/finish_weight_update", {})
            await self.api.post(engine, "/start_weight_update", {})

    async def close(self) -> None:
        """Per engine end, then continue (continuing first would make the end wait for the resumed requests);
        engines concurrently."""
        await all_or_first_error(*(self._close_one(e) for e in self.engines))

    async def _close_one(self, engine: EngineEndpoint) -> None:
        vllm = engine.kind == "vllm"
        if engine in self.begun:
            if vllm:
                await self.api.post(engine, "/finish_weight_update", {"weight_version": str(self.version)})
            else:
                await self.api.post(engine, "/end_weight_update", {})
            self.begun.remove(engine)
            self.marks.mark("ended_at")
        if engine in self.paused:
            await self.api.post(engine, "/resume" if vllm else "/continue_generation", {})
            self.paused.remove(engine)
            self.marks.mark("continued_at")

    def forget(self, listed: set[tuple[int, str, int]]) -> None:
        """Drop engines that are not in `listed` ((rank, ip, port)): nothing more is sent to them."""
        self.paused = [e for e in self.paused if (e.rank, e.ip, e.port) in listed]
        self.begun = [e for e in self.begun if (e.rank, e.ip, e.port) in listed]

    async def abandon(self, unreachable: str | None = None) -> str:
        """End every session still open, resume engines that were sent no bucket; a note on what is left.
        `unreachable`: an engine whose /health just did not answer, not called again (each call would wait out
        CLEANUP_TIMEOUT_SECONDS)."""
        timeout = CLEANUP_TIMEOUT_SECONDS
        ending = [e for e in self.begun if e.node_id != unreachable]
        ended = await asyncio.gather(
            *(self.api.post(e, _end_path(e), {}, timeout) for e in ending), return_exceptions=True
        )
        unended = [e.node_id for e, r in zip(ending, ended, strict=True) if _unreachable(r)]
        unended += [e.node_id for e in self.begun if e.node_id == unreachable]
        resume = [e for e in self.paused if e.node_id not in self.loaded and e.node_id != unreachable]
        await asyncio.gather(*(self.api.post(e, _resume_path(e), {}, timeout) for e in resume), return_exceptions=True)
        kept = [e.node_id for e in self.paused if e.node_id in self.loaded]
        self.begun, self.paused = [], []
        note = ""
        if kept:
            note += f"; left paused with a partial update (SGLang and vLLM have no rollback): {', '.join(kept)}"
        if unended:
            note += f"; could not end the weight-update session of {', '.join(unended)} (unreachable)"
        return note


class RolloutUpdater:
    """Pushes a state dict to every live rollout engine; one instance per trainer process."""

    def __init__(
        self,
        api: CoordinatorAPI,
        bootstrapper: GroupBootstrapper,
        sender: BucketSender,
        timeout_seconds: float,
        rollout_role: str = "rollout",
        token: str | None = None,
    ) -> None:
        self.api = api
        self.bootstrapper = bootstrapper
        self.sender = sender
        self.rollout_role = rollout_role
        self.weight_version = 0
        self.group: ActiveGroup | None = None
        self.engines = EngineAPI(token, timeout_seconds)
        # engines a colocated update takes (dcs_tasks/sync/colocated.py) are left out of the group
        self.is_colocated: Callable[[Any], bool] = lambda node: False

    async def aclose(self) -> None:
        await self._drop_group()
        await self.engines.aclose()

    async def endpoints(self) -> list[EngineEndpoint]:
        topology = await self.api.topology(self.rollout_role)
        nodes = [node for node in topology.nodes.get(self.rollout_role, {}).values() if not self.is_colocated(node)]
        return sorted((endpoint_of(node) for node in nodes), key=lambda e: e.rank)

    async def update(self, state: Mapping[str, torch.Tensor], quant: QuantizationConfig | None = None) -> UpdateReport:
        """One full update; returns what was sent and its metrics (seconds per phase, engines, version).

        With a group to reuse, the topology read, the engines' pause + begin and the packing of the first
        bucket run at once: nothing reaches an engine's weights or the wire until the topology confirmed the
        same engines and every session is open; when the engines changed, the sessions just opened are closed
        again (no bucket was sent) and the group is rebuilt."""
        started = time.perf_counter()
        marks = Marks(started)
        phases = marks.phases
        current = self.group
        if current is not None and current.plan.flattened and self.sender.backend.has_group(current.result.group_name):
            try:
                return await self._push(state, quant, current, False, marks)
            except _EnginesChanged:
                await self._drop_group()
        endpoints = await self.endpoints()
        phases["topology_seconds"] = time.perf_counter() - started
        if not endpoints:
            await self._drop_group()
            return UpdateReport(None, RolloutDetails(engines=0, weight_version=self.weight_version, total_seconds=0.0))
        rebuilt = await self._ensure_group(endpoints)
        phases["bootstrap_seconds"] = time.perf_counter() - started
        assert self.group is not None
        return await self._push(state, quant, self.group, rebuilt, marks, checked=True)

    async def _push(
        self,
        state: Mapping[str, torch.Tensor],
        quant: QuantizationConfig | None,
        group: ActiveGroup,
        rebuilt: bool,
        marks: Marks,
        checked: bool = False,
    ) -> UpdateReport:
        """Open the sessions (after confirming the engines from the topology unless `checked`), send, close."""
        version = self.weight_version + 1
        phases = marks.phases
        sessions = EngineSessions(self.engines, group.plan.engines, marks, version)
        ready = asyncio.ensure_future(self._ready(group, sessions, checked))
        try:
            if not group.plan.flattened:  # one broadcast per tensor: nothing to pack ahead
                await asyncio.shield(ready)
            announce = self._announcer(group, version, sessions)
            send = self.sender.send_fused if group.plan.flattened else self.sender.send_per_tensor
            sent = await send(state, group.result.group_name, announce, quant, ready=ready)
            closing = time.perf_counter()
            await sessions.close()
            phases["close_seconds"] = time.perf_counter() - closing
        except _EnginesChanged as changed:  # nothing was sent: close what was opened, keep generation going
            sessions.forget(changed.listed)  # engines gone from the topology are not called (maybe dead)
            await sessions.abandon()
            raise
        except _TopologyUnread as exc:  # the coordinator did not answer: nothing was sent, the group stays
            await sessions.abandon()
            raise exc.error from exc.error.__cause__
        except WeightSyncError as exc:
            await _cancel(ready)
            await self._drop_group()
            blamed = None if exc.member else await self._blame(group.plan.engines)  # first: abandon skips it
            # a member that timed out or refused connections is not called again either: each call would
            # wait out CLEANUP_TIMEOUT_SECONDS
            silent = exc.member if exc.member and _got_no_connection_or_answer(exc) else None
            note = await sessions.abandon(unreachable=blamed or silent)
            member = exc.member or blamed
            raise type(exc)(f"update v{version} failed (member: {member or 'unknown'}): {exc}{note}", member) from exc
        except BaseException:
            await _cancel(ready)
            await self._drop_group()
            await sessions.abandon()
            raise
        self.weight_version = version
        details = RolloutDetails(
            engines=len(group.plan.engines),
            weight_version=version,
            total_seconds=time.perf_counter() - marks.started,
            group_name=group.result.group_name,
            group_rebuilt=rebuilt,
            flattened=group.plan.flattened,
            phases=dict(phases),
        )
        return UpdateReport(sent, details)

    async def _ready(self, group: ActiveGroup, sessions: EngineSessions, checked: bool) -> None:
        """Resolves once the engines are confirmed (topology) and every session is open; the sender sends no
        request and no byte before. Raises _EnginesChanged / _TopologyUnread (nothing sent yet)."""
        opening = asyncio.ensure_future(sessions.open())
        try:
            if not checked:
                try:
                    endpoints = await self.endpoints()
                except DCSError as exc:
                    raise _TopologyUnread(exc) from exc
                sessions.marks.mark("topology_seconds")
                sessions.marks.mark("bootstrap_seconds")
                if signature_of(endpoints) != group.plan.signature:  # an engine replaced, added, gone or restarted
                    raise _EnginesChanged({(e.rank, e.ip, e.port) for e in endpoints})
            await asyncio.shield(opening)
            sessions.marks.mark("ready_seconds")
        finally:
            await _cancel(opening)

    async def _ensure_group(self, endpoints: list[EngineEndpoint]) -> bool:
        current = self.group
        if (
            current is not None
            and current.plan.signature == signature_of(endpoints)
            and self.sender.backend.has_group(current.result.group_name)
        ):
            return False
        await self._drop_group()
        self.bootstrapper.check_reachable(endpoints)  # a loopback master with a remote engine: at once
        infos = await self._probe(endpoints)
        plan = plan_rollout_group(endpoints, {e.node_id: info for e, info in zip(endpoints, infos, strict=True)})
        self.group = await self.bootstrapper.form_group(plan)
        timeout = PROBE_TIMEOUT_SECONDS
        versions = await asyncio.gather(*(self.engines.weight_version(e, timeout) for e in plan.engines))
        self.weight_version = max(self.weight_version, *versions)
        return True

    async def _probe(self, endpoints: list[EngineEndpoint]) -> list[EngineInfo]:
        """Every engine's `/server_info`, read once per group formation. An engine that does not answer is
        retried like a failed join (`max_retries`, backoff), then GroupInitError names it; an incompatible
        engine or a refused API key raises at once."""
        config = self.bootstrapper.config
        last: WeightSyncError | None = None
        for attempt in range(config.task.max_retries + 1):
            if attempt:
                await asyncio.sleep(
                    backoff_delay(
                        attempt - 1, config.task.retry_delay_seconds, config.task.retry_backoff_max_seconds, "none"
                    )
                )
            try:
                return await all_or_first_error(*(self.engines.probe(e, PROBE_TIMEOUT_SECONDS) for e in endpoints))
            except (EngineIncompatible, EngineAuthRefused):
                raise
            except WeightSyncError as exc:
                last = exc
        assert last is not None
        raise GroupInitError(
            f"group formation failed after {config.task.max_retries + 1} attempts: {last}", last.member
        )

    async def _drop_group(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            await self.bootstrapper.release(group)

    def _announcer(self, group: ActiveGroup, version: int, sessions: EngineSessions) -> Announce:
        engines = group.plan.engines
        load_format = SGLANG_FLAT_FORMAT if group.plan.flattened else None

        async def announce(index: int, layout: FusionLayout, last: bool) -> None:
            dtypes = [s.dtype for s in layout.specs]
            shapes = [list(s.shape) for s in layout.specs]
            vllm_body = vllm_protocol.update_body(layout.names, dtypes, shapes)
            body = UpdateWeightsFromDistributedRequest(
                names=layout.names,
                dtypes=[s.dtype for s in layout.specs],
                shapes=[list(s.shape) for s in layout.specs],
                group_name=group.result.group_name,
                weight_version=str(version) if last else None,  # SGLang publishes a named version at once
                flush_cache=last,
                load_format=load_format,
            ).wire()
            sessions.loaded.update(e.node_id for e in engines)
            sessions.marks.mark("first_request_at" if index == 0 else "last_request_at")
            t0 = time.perf_counter()
            await all_or_first_error(
                *(
                    self.engines.post(e, "/update_weights", vllm_body)
                    if e.kind == "vllm"
                    else self.engines.post(e, "/update_weights_from_distributed", body)
                    for e in engines
                )
            )
            sessions.marks.add("requests_seconds", time.perf_counter() - t0)

        return announce

    async def _blame(self, engines: tuple[EngineEndpoint, ...]) -> str | None:
        """The first engine whose GET /health does not answer within BLAME_TIMEOUT_SECONDS (None if all do)."""
        for engine in engines:
            if not await self.engines.alive(engine, BLAME_TIMEOUT_SECONDS):
                return engine.node_id
        return None


def _end_path(engine: EngineEndpoint) -> str:
    return "/finish_weight_update" if engine.kind == "vllm" else "/end_weight_update"


def _resume_path(engine: EngineEndpoint) -> str:
    return "/resume" if engine.kind == "vllm" else "/continue_generation"


def _got_no_connection_or_answer(exc: BaseException) -> bool:
    """Whether `exc` came from an engine call that timed out or could not connect (its cause chain)."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return False
        if isinstance(seen, EngineTimeout | ConnectError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _unreachable(result: object) -> bool:
    """Whether an end call failed without an answer (an answer refusing it means no session was open)."""
    return isinstance(result, BaseException) and (
        not isinstance(result, WeightSyncError) or isinstance(result.__cause__, EngineHTTPError)
    )


class _EnginesChanged(Exception):
    """The topology no longer lists the group's engine processes (the same instances at the same addresses):
    rebuild before sending."""

    def __init__(self, listed: set[tuple[int, str, int]]) -> None:
        super().__init__("the rollout engines changed")
        # (rank, ip, port) of every engine the topology lists now: a restarted engine at its old address is
        # still called (to end the session and resume generation opened on it meanwhile)
        self.listed = listed


class _TopologyUnread(Exception):
    """The coordinator's topology could not be read; `error` is what the read raised."""

    def __init__(self, error: DCSError) -> None:
        super().__init__(str(error))
        self.error = error


async def _cancel(future: asyncio.Future[Any]) -> None:
    if not future.done():
        future.cancel()
    await asyncio.gather(future, return_exceptions=True)
