"""`CheckpointEngineClient`: the trainer's / engine's handle on DCS (the original design's client/engine.py).

It wires parts, it does not implement them: a `CoordinatorAPI` (registration, heartbeats, topology), a
`DeviceDirectBackend` (groups, broadcasts), a `RolloutUpdater` (actor -> rollout), an `ActorFwdSender` /
`ActorFwdReceiver` (actor -> actor_fwd / reference) and, for checkpoints, a `Checkpointer`.
Call order: `await start()` -> updates / receives -> `await stop()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Any

import torch

from dcs_tasks.aiotask import cancel_and_wait
from dcs_tasks.backends.device_direct import DeviceDirectBackend
from dcs_tasks.celery_app import TaskName, make_celery
from dcs_tasks.config import BackendType, DCSConfig, RoleInfo
from dcs_tasks.coordinator_api import CoordinatorAPI
from dcs_tasks.errors import (
    CoordinatorError,
    DCSError,
    DCSTimeoutError,
    NodeNotFound,
    RankConflict,
    SaveFailed,
    WeightSyncError,
)
from dcs_tasks.hostagent import NodeLiveness
from dcs_tasks.metrics import get_metrics
from dcs_tasks.netaddr import configure_comm_interface, route_address
from dcs_tasks.sync.actor_fwd import (
    ActorFwdReceiver,
    ActorFwdSender,
    needs_ref_update,
    stage_specs,
    wait_for_sources,
)
from dcs_tasks.sync.bootstrap_client import GroupBootstrapper, check_backend, send_teardown
from dcs_tasks.sync.colocated import ColocatedUpdater
from dcs_tasks.sync.gcpause import paused_gc
from dcs_tasks.sync.receiving import WeightReceiver
from dcs_tasks.sync.rollout import RolloutUpdater
from dcs_tasks.sync.sender import ALONE_BYTES, BucketSender, UpdateReport
from dcs_tasks.sync.wire import BootstrapRequest, BootstrapResult, GroupPlan, QuantizationConfig

log = logging.getLogger(__name__)
RECEIVING_ROLES = ("actor_fwd", "reference")


def _state_of(model: Any) -> dict[str, torch.Tensor]:
    """`model.state_dict()`; for a sequence of model chunks (the original design's `model`), their union."""
    if model is None:
        raise WeightSyncError("this client has no model to push weights from")
    chunks = model if isinstance(model, Sequence) else [model]
    state: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        state.update(chunk.state_dict() if hasattr(chunk, "state_dict") else dict(chunk))
    return state


class CheckpointEngineClient:
    """One node of a DCS deployment (`role`, `rank`). Not thread-safe; use from one event loop."""

    def __init__(
        self,
        args: Any = None,
        coordinator_url: str | None = None,
        role: str = "actor",
        rank: int | None = 0,
        backend_type: BackendType = BackendType.GLOO,
        device_id: int | None = None,
        model: Any = None,
        model_name: str = "model",
        config: DCSConfig | None = None,
        quantization_config: QuantizationConfig | None = None,
        lock: Any = None,
        ip: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        rollout_role: str = "rollout",
        world_size: int | None = None,
    ) -> None:
        base = config or DCSConfig()
        self.config = base.model_copy(update={"coordinator_url": coordinator_url}) if coordinator_url else base
        self.args = args
        self.model = model
        self.model_name = model_name
        self.quantization_config = quantization_config
        self.lock = lock
        # ip: the address registered and used as weight-sync master; default: the one that routes to the coordinator
        address = ip or self.config.sync.advertise_address or route_address(self.config.base_url)
        self.role_info = RoleInfo(
            role_name=role,
            rank=rank,
            ip=address,
            device_id=device_id,
            world_size=world_size,
            metadata=dict(metadata or {}),
        )
        self.backend_type = backend_type
        self.rollout_role = rollout_role
        self._backend: DeviceDirectBackend | None = None
        self._api: CoordinatorAPI | None = None
        self._beats: NodeLiveness | None = None
        self._rollout: RolloutUpdater | None = None
        self._colocated: ColocatedUpdater | None = None  # engines colocated with this rank (by handle)
        self._fwd_sender: ActorFwdSender | None = None
        self._fwd_receiver: ActorFwdReceiver | None = None
        self._bootstrapper: GroupBootstrapper | None = None
        self._background: asyncio.Task[None] | None = None
        self._checkpointer: Any = None

    # --- properties (the original design's) ----------------------------------------------------------------
    @property
    def role(self) -> str:
        return self.role_info.role_name

    @property
    def rank(self) -> int | None:
        return self.role_info.rank

    @property
    def world_size(self) -> int | None:
        return self.role_info.world_size

    @property
    def node_id(self) -> str:
        return self.role_info.node_id

    @property
    def is_registered(self) -> bool:
        """True while this client holds its rank: started, and its heartbeats were not fenced off because
        another node registered the same rank (`RankConflict`)."""
        return self._beats is not None and self._beats.lost is None

    @property
    def backend(self) -> DeviceDirectBackend | None:
        return self._backend

    @property
    def weight_version(self) -> int:
        """Rollout weight version (actor) or received version (actor_fwd / reference)."""
        if self._fwd_receiver is not None:
            return self._fwd_receiver.receiver.weight_version
        return self._rollout.weight_version if self._rollout is not None else 0

    @property
    def received_weights(self) -> dict[str, torch.Tensor]:
        """The last complete update an actor_fwd / reference received."""
        return self._fwd_receiver.receiver.weights if self._fwd_receiver is not None else {}

    def _require_api(self) -> CoordinatorAPI:
        if self._api is None:
            raise DCSError("client not started: await client.start() first")
        return self._api

    # --- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        """Check that the backend can run here, create the HTTP client, register (with a pp master port for pp
        source actors), start heartbeats, build the backend and the updaters.

        `BackendUnavailable` (NCCL without CUDA, a device id this host lacks, an unknown backend) is raised
        first, before anything is registered or any engine is asked to join."""
        cfg = self.config
        self.backend_type = check_backend(self.backend_type, self.role_info.device_id)
        configure_comm_interface(self.role_info.ip, cfg.sync.comm_ifname)  # before any gloo/NCCL group is built
        self._api = CoordinatorAPI(cfg.base_url, cfg.token(), timeout=cfg.coordinator.request_timeout_seconds)
        self._backend = DeviceDirectBackend(
            self.backend_type,
            self.role_info,
            cfg.sync.comm_timeout_seconds,
            cfg.sync.group_init_timeout_seconds,
            self.role_info.device_id,
            fusion_threshold_bytes=cfg.sync.tensor_fusion_threshold,
        )
        celery = make_celery(cfg)
        prefix = f"{self.model_name}-{self.role}{self.rank if self.rank is not None else ''}"
        self._bootstrapper = GroupBootstrapper(cfg, celery, self._backend, prefix, self.role_info.ip)
        if (
            self.role == "actor"
            and self.role_info.metadata.get("is_pp_src_rank")
            and "master_port" not in self.role_info.metadata
        ):
            await self._reserve_pp_port(prefix)
        # through the host's agent (`dcs worker`) when one answers, else beating per node (dcs_tasks/hostagent.py)
        self._beats = NodeLiveness(self._api, cfg, self.role_info)
        # a predecessor of this trainer that died or froze without unregistering holds the rank until its
        # heartbeat TTL runs out: wait that long for it (the coordinator refuses to hand a live node's rank over)
        answer = await self._beats.register(wait_for_rank_s=self._beats.predecessor_wait_s)
        self.role_info = self.role_info.model_copy(update={"rank": answer.rank})
        self._beats.start()
        from dcs_tasks.checkpoint.telemetry import serve_trainer_metrics

        serve_trainer_metrics(cfg)  # DCS_TRAINER_METRICS_PORT: a weight-sync-only trainer serves its metrics too
        self._build_updaters()
        log.info("registered as %s", answer.node_id)

    async def _reserve_pp_port(self, prefix: str) -> None:
        """Reserve this pp stage's master port through the bootstrap task (a group without engines)."""
        assert self._bootstrapper is not None
        request = BootstrapRequest(
            group_prefix=f"{prefix}-pp",
            master_address=self.role_info.ip,
            plan=GroupPlan(world_size=1, engines=()),
            backend=self.backend_type,
        )
        raw = await self._bootstrapper.run_task(TaskName.BOOTSTRAP_GROUP, request.model_dump(mode="json"))
        result = BootstrapResult.model_validate(raw)
        self.role_info.metadata.update(
            master_address=result.master_address, master_port=result.master_port, pp_group_name=result.group_name
        )

    def _build_updaters(self) -> None:
        assert self._api is not None and self._backend is not None and self._bootstrapper is not None
        cfg = self.config
        if self.role in RECEIVING_ROLES:
            receiver = WeightReceiver(self._backend, self._backend.device)
            model = self.model if isinstance(self.model, torch.nn.Module) else None
            self._fwd_receiver = ActorFwdReceiver(self._api, receiver, cfg.sync.comm_timeout_seconds, model)
            return
        backend = self._backend

        def sender(sglang: bool) -> BucketSender:
            # SGLang takes one bucket per request, each answered before the next is sent: fewer, fuller buckets
            # beat sending big tensors alone from their own memory (512 MiB, 2 receivers: 0.59 s against 1.20 s)
            alone = None if sglang else ALONE_BYTES
            return BucketSender(backend, backend.device, cfg.sync.bucket_size_bytes, alone_bytes=alone, sglang=sglang)

        self._rollout = RolloutUpdater(
            self._api, self._bootstrapper, sender(True), cfg.sync.comm_timeout_seconds, self.rollout_role, cfg.token()
        )
        self._colocated = ColocatedUpdater.beside(self._rollout, self.rank or 0, backend.device, cfg.token())
        pp_rank = int(self.role_info.metadata.get("pp_rank", 0))
        self._fwd_sender = ActorFwdSender(self._api, sender(False), pp_rank)

    async def stop(self) -> None:
        """Cancel heartbeats and background receives, unregister the node, release groups, close the backend, the
        checkpointer and the HTTP client. A `SaveFailed` from the checkpointer's close (a failed save not raised
        yet) is raised once all of it is closed. Stopping again does nothing more.

        The unregister is best effort, fenced with the node's identity (X-DCS-Node: a successor that took the rank
        over is never removed) and bounded by `request_timeout_seconds`: a coordinator that does not answer, or
        refuses, is logged and the node leaves the topology once its heartbeats expire, as before."""
        if self._background is not None:
            await cancel_and_wait(self._background)
        if self._beats is not None:
            beats, self._beats = self._beats, None
            await beats.stop()  # an agent stops beating the node before it is removed
            await self._unregister(beats)
        if self._rollout is not None:
            await self._rollout.aclose()
        if self._colocated is not None:
            await self._colocated.aclose()
        await self._release_pp_port()
        if self._backend is not None:
            self._backend.close()
        failed: SaveFailed | None = None
        if self._checkpointer is not None:
            try:
                self._checkpointer.close()
            except SaveFailed as exc:
                failed = exc
        if self._api is not None:
            await self._api.aclose()
            self._api = None
        if failed is not None:
            raise failed

    async def _unregister(self, beats: NodeLiveness) -> None:
        """Remove the node `beats` kept alive, fenced with the identity its registration got; logs what fails."""
        role, rank, api = beats.info.role_name, beats.info.rank, self._api
        if api is None or rank is None:
            return
        if beats.lost is not None:  # another node holds the rank now: nothing of ours to remove
            log.info("not unregistering %s: the rank was taken over (%s)", beats.info.node_id, beats.lost)
            return
        if not api.identity_of(role, rank):  # never registered (start() failed before): an unfenced call could
            return  # remove another node holding that rank
        limit = self.config.coordinator.request_timeout_seconds
        try:
            async with asyncio.timeout(limit):
                await api.unregister(role, rank)
            log.info("unregistered %s", beats.info.node_id)
        except NodeNotFound:
            log.info("%s was already gone from the coordinator", beats.info.node_id)
        except RankConflict as exc:
            log.warning("not unregistering %s: another node holds the rank now: %s", beats.info.node_id, exc)
        except (CoordinatorError, TimeoutError) as exc:
            why = f"no answer in {limit:g}s" if isinstance(exc, TimeoutError) else str(exc)
            log.warning("unregistering %s failed (its heartbeats will expire): %s", beats.info.node_id, why)

    async def _release_pp_port(self) -> None:
        name = self.role_info.metadata.pop("pp_group_name", None)
        if name and self._bootstrapper is not None:
            from dcs_tasks.sync.wire import DestroyRequest

            request = DestroyRequest(
                group_name=name, host=self.config.host_name, master_port=int(self.role_info.metadata["master_port"])
            )
            send_teardown(self._bootstrapper.celery, request, self.config.host_name)

    # --- weight sync ----------------------------------------------------------------------------
    async def update_weights_for_rollout(
        self, rollout_only: bool = False, actor_fwd_only: bool = False, quantization: QuantizationConfig | None = None
    ) -> dict[str, Any]:
        """Push `model.state_dict()` to rollout engines and/or the actor_fwd/reference group; returns metrics."""
        self._require_api()
        state = _state_of(self.model)
        quant = quantization or self.quantization_config
        started = time.perf_counter()
        reports: dict[str, UpdateReport] = {}
        try:
            async with _held(self.lock, self.config.sync.comm_timeout_seconds):
                with paused_gc(self.config.sync.pause_gc):
                    if not actor_fwd_only and self._rollout is not None:
                        if self._colocated is not None:
                            self._colocated.begin()
                        reports["rollout"] = await self._rollout.update(state, quant)
                        if self._colocated is not None:  # one update: remote engines, then colocated ones
                            colocated = await self._colocated.update_after(self._rollout, state)
                            if colocated is not None:
                                reports["colocated"] = colocated
                    if not rollout_only and self._fwd_sender is not None and self._fwd_sender.spec is not None:
                        reports["actor_fwd"] = await self._fwd_sender.update(state, quant)
        except WeightSyncError as exc:
            get_metrics().record_error(type(exc).__name__)
            raise
        metrics: dict[str, Any] = {part: report.as_dict() for part, report in reports.items()}
        metrics["total_seconds"] = time.perf_counter() - started
        record_send(reports.values())
        return metrics

    async def init_process_groups_for_actor_fwd_ref(self, rollout_id: int, wait_timeout_s: float | None = None) -> bool:
        """Form this update's actor -> actor_fwd(/reference) groups; every participant calls it with the same
        `rollout_id`. Returns False when this node sits this one out: a reference outside its interval, or an
        actor that is not its pp stage's source (metadata `is_pp_src_rank`) while another actor is.

        An actor_fwd / reference that calls it before the source actor of every pp stage registered waits for
        them, at most `wait_timeout_s` (default `group_init_timeout_seconds`), then raises `ActorWaitTimeout`.
        An actor whose stage has no source raises `SyncPreconditionError` saying what metadata to set."""
        api = self._require_api()
        need_ref = needs_ref_update(rollout_id, self.config.sync.ref_update_interval)
        if self.role == "reference" and not need_ref:
            return False
        assert self.rank is not None
        if self._fwd_receiver is not None:
            timeout = self.config.sync.group_init_timeout_seconds if wait_timeout_s is None else wait_timeout_s
            ranks = await wait_for_sources(api, self.role, self.rank, need_ref, timeout)
            await self._fwd_receiver.init_groups(ranks, stage_specs(ranks, rollout_id, self.backend_type))
            return True
        ranks = await api.model_update_group_ranks(self.role, self.rank, need_ref)
        specs = stage_specs(ranks, rollout_id, self.backend_type)
        if self._fwd_sender is None:
            return False
        is_source = bool(self.role_info.metadata.get("is_pp_src_rank"))
        return await self._fwd_sender.init_group(specs, self.rank, is_source)

    async def recv_weight(self) -> int:
        """actor_fwd / reference: receive one whole update (applied to `model` if given); returns its version."""
        if self._fwd_receiver is None:
            raise WeightSyncError(f"recv_weight is for actor_fwd / reference nodes, not {self.role}")
        started = time.perf_counter()
        with paused_gc(self.config.sync.pause_gc):
            version = await self._fwd_receiver.recv_weight()
        _record_recv(self._fwd_receiver.receiver.weights, time.perf_counter() - started)
        return version

    async def recv_weight_fully_async(self) -> asyncio.Task[None]:
        """Start receiving every update in the background (until `stop()`); returns at once with the task
        (awaiting the task itself waits until it fails or is cancelled)."""

        async def loop() -> None:
            while True:
                await self.recv_weight()

        self._background = asyncio.create_task(loop(), name=f"dcs-recv-{self.node_id}")
        return self._background

    # --- checkpoints ----------------------------------------------------------------------------
    def _checkpoints(self) -> Any:
        if self._checkpointer is None:
            from dcs_tasks.checkpoint import Checkpointer  # lazy: staging is only built when used

            self._checkpointer = Checkpointer(self.model_name, self.config)
        return self._checkpointer

    def save_checkpoint(self, step: int, state: Any = None, metadata: dict[str, Any] | None = None) -> Any:
        """Asynchronous save of `state` (default: the model's state dict); returns a PendingCheckpoint."""
        return self._checkpoints().save(state if state is not None else _state_of(self.model), step, metadata)

    def load_checkpoint(self, step: int | None = None, into: Any = None) -> Any:
        """Restore `step` (default: latest) into `into` (default: the model's state dict)."""
        target = into if into is not None else (_state_of(self.model) if self.model is not None else None)
        return self._checkpoints().restore(step, into=target)


def record_send(reports: Iterable[UpdateReport]) -> None:
    """Count the bytes and time of what each report says was sent in `dcs_sync_*` metrics (nothing sent: nothing)."""
    for report in reports:
        if report.sent is not None and report.sent.bytes:
            get_metrics().record_send(report.sent.bytes, report.sent.total_seconds)


def _record_recv(weights: Mapping[str, torch.Tensor], seconds: float) -> None:
    get_metrics().record_recv(sum(t.numel() * t.element_size() for t in weights.values()), seconds)


async def create_client(**kwargs: Any) -> CheckpointEngineClient:
    """Build a `CheckpointEngineClient(**kwargs)` and `await start()` it."""
    client = CheckpointEngineClient(**kwargs)
    await client.start()
    return client


@contextlib.asynccontextmanager
async def _held(lock: Any, timeout: float) -> AsyncIterator[None]:
    """Hold the original design's `lock` (an asyncio lock, or a threading/multiprocessing one, taken off the event loop)
    for the length of a weight update, so updates guarded by one lock never overlap. None: no lock.
    DCSTimeoutError when it is not free within `timeout`; a cancelled wait never leaves it taken."""
    if lock is None:
        yield
        return
    if isinstance(lock, asyncio.Lock):
        try:
            async with asyncio.timeout(timeout):
                await lock.acquire()
        except TimeoutError:
            raise DCSTimeoutError(f"the update lock was not free within {timeout:g}s") from None
    else:
        acquiring = asyncio.ensure_future(asyncio.to_thread(lock.acquire, True, timeout))
        try:
            got = await asyncio.shield(acquiring)
        except asyncio.CancelledError:  # the thread may still get it: hand it straight back
            acquiring.add_done_callback(lambda f: f.cancelled() or f.exception() or not f.result() or lock.release())
            raise
        if not got:
            raise DCSTimeoutError(f"the update lock was not free within {timeout:g}s")
    try:
        yield
    finally:
        lock.release()
