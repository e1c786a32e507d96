"""verl: `DCSCheckpointEngine`, a backend of verl's `checkpoint_engine` registry that moves weights through DCS.

    # verl's config (rollout.checkpoint_engine):
    #   backend: dcs
    #   custom_backend_module: dcs_tasks.integrations.verl     # imported on every worker: registers "dcs"
    #   engine_kwargs: {dcs: {coordinator_url: http://COORDINATOR:8000, model_name: my-run}}

verl builds one engine per worker with `CheckpointEngineRegistry.new("dcs", bucket_size=..., **engine_kwargs)`:
on the trainer's workers with `is_master=(rank == 0)`, on the rollout workers without `is_master`. So the trainer's
rank 0 becomes a DCS `actor` (the source of pp stage 0), each rollout worker a DCS `actor_fwd` receiver, and the
other trainer ranks only walk verl's weight generator (producing each weight is collective over the trainer's ranks).
Per update verl's `CheckpointEngineManager` calls `prepare` (registers with the DCS coordinator the first time),
`build_topology`, `init_process_group` (DCS's `init_process_groups_for_actor_fwd_ref`: the group forms through the
coordinator's ranks and a `dcs worker`'s master-port reservation), then `send_weights` / `receive_weights` at once,
then `finalize`. `send_weights` takes verl's (name, tensor) generator, checks every entry and sends the whole state
through DCS's buckets (`update_weights_for_rollout(actor_fwd_only=True)`: bucket meta through the coordinator, one
broadcast per bucket); `receive_weights` receives the whole update, which a DCS receiver commits only once every
bucket arrived, and yields (name, tensor). A generator entry DCS cannot move (not a tensor, a name that is not a
string or is longer than the receivers accept, a dtype outside `dcs_tasks/tensors.py`, a name twice) raises
`InvalidWeight` naming it before anything is sent, so no receiver commits anything of that update.

The engine keeps its DCS client on an event loop of its own (a daemon thread), so verl may call its synchronous
methods from any thread and its coroutines from any event loop. `close()` unregisters the node.

Not supported: more than one trainer process sending (DCS gathers no shards: verl's generator already yields full
tensors on rank 0), quantization, and `CheckpointEngineWithCache`'s partial rollout (`get_weights` yields the last
update received, nothing more). The whole state is held by the sending rank for the update's length, as the
generator yields it: memory for one more copy of the model's full weights there.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Iterable, Mapping
from concurrent.futures import Future
from typing import Any, TypeVar

import torch
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from dcs_tasks.client.engine import CheckpointEngineClient
from dcs_tasks.config import BackendType, DCSConfig
from dcs_tasks.errors import InvalidTensorSpec, SyncPreconditionError, WeightSyncError
from dcs_tasks.sync.receive_checks import MAX_NAME_LENGTH
from dcs_tasks.tensors import info_of

log = logging.getLogger(__name__)
T = TypeVar("T")
BACKEND = "dcs"
ACTOR, RECEIVER = "actor", "actor_fwd"


class InvalidWeight(InvalidTensorSpec):
    """An entry of verl's weight generator that DCS cannot send; names the entry. Nothing of the update is sent."""


def _shown(name: object) -> str:
    text = repr(name)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(str(name))} characters)"


def check_weights(weights: Iterable[tuple[Any, Any]]) -> dict[str, torch.Tensor]:
    """verl's (name, tensor) entries as a state dict; `InvalidWeight` naming the first entry DCS cannot send."""
    state: dict[str, torch.Tensor] = {}
    for index, entry in enumerate(weights):
        if not (isinstance(entry, tuple) and len(entry) == 2):
            raise InvalidWeight(f"weight entry {index} is {type(entry).__name__}, not a (name, tensor) pair")
        name, tensor = entry
        state[_checked(name, tensor, state)] = tensor
    return state


def _checked(name: Any, tensor: Any, seen: Mapping[str, torch.Tensor]) -> str:
    if not isinstance(name, str) or not name:
        raise InvalidWeight(f"weight name {_shown(name)} is not a non-empty string")
    if len(name) > MAX_NAME_LENGTH:
        raise InvalidWeight(
            f"weight {_shown(name)}: its name has {len(name)} characters; DCS receivers take at most {MAX_NAME_LENGTH}"
        )
    if not isinstance(tensor, torch.Tensor):
        raise InvalidWeight(f"weight {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
    if tensor.layout != torch.strided:
        raise InvalidWeight(f"weight {name!r} has layout {tensor.layout}; DCS sends dense (strided) tensors only")
    try:
        info_of(tensor.dtype, name)
    except InvalidTensorSpec as exc:
        raise InvalidWeight(str(exc)) from None
    if name in seen:
        raise InvalidWeight(f"weight {name!r} was yielded twice in one update")
    return name


class _Loop:
    """An event loop on a daemon thread: the DCS client's home, whatever thread or loop verl calls from."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def submit(self, coro: Awaitable[T]) -> Future[T]:
        async def run() -> T:
            return await coro

        return asyncio.run_coroutine_threadsafe(run(), self.loop)

    def call(self, coro: Awaitable[T], timeout: float) -> T:
        return self.submit(coro).result(timeout)

    async def wait(self, coro: Awaitable[T]) -> T:
        return await asyncio.wrap_future(self.submit(coro))

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        if not self.thread.is_alive():
            self.loop.close()


@CheckpointEngineRegistry.register(BACKEND)
class DCSCheckpointEngine(CheckpointEngine):
    """verl's checkpoint engine over DCS weight sync (module docstring). verl passes `bucket_size` and, on the
    trainer's workers only, `is_master`; the rest comes from `engine_kwargs["dcs"]`:

    - `coordinator_url`: the DCS coordinator (default: `DCS_COORDINATOR_URL` / DCS's configuration);
    - `model_name`: names this run's nodes and groups in DCS (default "verl");
    - `backend`: "gloo" (default) or "nccl" (the current CUDA device);
    - `config`: a `DCSConfig` or a dict of its fields (else DCS_* from the environment).

    DCS buckets are `bucket_size` bytes (verl's `update_weights_bucket_megabytes`) unless `config` sets
    `bucket_size_bytes`."""

    def __init__(
        self,
        bucket_size: int,
        is_master: bool | None = None,
        coordinator_url: str | None = None,
        model_name: str = "verl",
        backend: str = "gloo",
        config: DCSConfig | Mapping[str, Any] | None = None,
    ) -> None:
        if config is None:
            base = DCSConfig().model_copy(update={"bucket_size_bytes": int(bucket_size)})
        elif isinstance(config, DCSConfig):
            base = config
        else:
            base = DCSConfig(**{"bucket_size_bytes": int(bucket_size), **config})
        self.config = base.model_copy(update={"coordinator_url": coordinator_url}) if coordinator_url else base
        self.bucket_size = int(bucket_size)
        self.role = RECEIVER if is_master is None else (ACTOR if is_master else None)
        self.model_name = model_name
        self.backend_type = BackendType(backend)
        self.updates = 0  # updates this engine sent or received: build_topology derives the group's id from it
        self.client: CheckpointEngineClient | None = None
        self._loop: _Loop | None = None
        self.rollout_id: int | None = None

    # --- verl's protocol ------------------------------------------------------------------------------------
    def prepare(self) -> dict[str, Any]:
        """Register with the DCS coordinator (first call only); the metadata `build_topology` reads."""
        if self.role is not None and self.client is None:
            self._start()
        rank = self.client.rank if self.client is not None else None
        return {"dcs_role": self.role, "dcs_rank": rank, "updates": self.updates, "model_name": self.model_name}

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """Every worker joins this update's groups under one `rollout_id`; DCS's coordinator assigns the ranks."""
        actors, rollouts = metadata[:actor_wg_world_size], metadata[actor_wg_world_size:]
        if len(rollouts) != rollout_world_size:
            raise SyncPreconditionError(
                f"verl handed {len(metadata)} workers' metadata for {actor_wg_world_size} trainer and "
                f"{rollout_world_size} rollout workers"
            )
        sources = [i for i, m in enumerate(actors) if m.get("dcs_role") == ACTOR]
        if sources != [0]:
            raise SyncPreconditionError(
                f"the DCS backend sends from trainer rank 0 only (verl's is_master=True there); trainer workers "
                f"marked as the source: {sources}"
            )
        strays = [i for i, m in enumerate(rollouts) if m.get("dcs_role") != RECEIVER]
        if strays:
            raise SyncPreconditionError(
                f"rollout workers {strays} were not built as DCS receivers (is_master must not be passed to them)"
            )
        rollout_id = 1 + max(int(m.get("updates", 0)) for m in metadata)
        return {"rollout_id": [rollout_id] * actor_wg_world_size}, {"rollout_id": [rollout_id] * rollout_world_size}

    def init_process_group(self, rollout_id: int) -> None:
        """Join this update's DCS group (all workers at once, as verl calls it); bounded by DCS's group timeout."""
        self.rollout_id = rollout_id
        if self.client is None:
            return
        timeout = self.config.sync.group_init_timeout_seconds * 2 + 30
        self._run(self.client.init_process_groups_for_actor_fwd_ref(rollout_id), timeout)

    def finalize(self) -> None:
        """Nothing to free: the client stays registered and DCS re-forms the group at the next update's id."""
        self.rollout_id = None

    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, Any]:
        """Check verl's (name, tensor) entries, then send them through DCS's buckets; DCS's figures as metrics."""
        if self.role == RECEIVER:
            raise WeightSyncError("send_weights was called on a rollout worker's DCS engine (it receives)")
        state = check_weights([entry async for entry in _entries(weights)])
        if self.client is None:  # a trainer rank other than 0: it only walked the generator
            self.updates += 1
            return {}
        client = self.client
        if self.rollout_id is None:
            raise WeightSyncError("send_weights before init_process_group: the DCS group of this update is not formed")
        client.model = state
        try:
            metrics = await self._wait(client.update_weights_for_rollout(actor_fwd_only=True))
        finally:
            client.model = None
        self.updates += 1
        sent = metrics.get("actor_fwd")
        if not sent:
            raise WeightSyncError(f"DCS sent nothing for update {self.rollout_id}: no actor_fwd group ({metrics})")
        return {f"dcs/{key}": sent[key] for key in ("bytes", "tensors", "buckets", "total_seconds") if key in sent}

    async def receive_weights(self, global_steps: int | None = None) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Receive one whole update (committed only once complete), then yield its (name, tensor) pairs."""
        if self.client is None or self.role != RECEIVER:
            raise WeightSyncError("receive_weights was called on a DCS engine that is not a rollout worker's")
        if self.rollout_id is None:
            raise WeightSyncError(
                "receive_weights before init_process_group: the DCS group of this update is not formed"
            )
        started = time.perf_counter()
        version = await self._wait(self.client.recv_weight())
        self.updates += 1
        weights = dict(self.client.received_weights)
        log.info(
            "received DCS weight version %d (%d tensors) in %.3fs", version, len(weights), time.perf_counter() - started
        )
        for name, tensor in weights.items():
            yield name, tensor

    async def get_weights(self) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """The last update this rollout worker received (empty before the first)."""
        weights = dict(self.client.received_weights) if self.client is not None else {}
        for name, tensor in weights.items():
            yield name, tensor

    def close(self) -> None:
        """Unregister from the coordinator and stop the engine's loop (verl has no call for it: call it at exit)."""
        if self.client is not None and self._loop is not None:
            try:
                self._loop.call(self.client.stop(), self.config.coordinator.request_timeout_seconds * 3 + 10)
            finally:
                self.client = None
        if self._loop is not None:
            self._loop.close()
            self._loop = None

    # --- internals ------------------------------------------------------------------------------------------
    def _start(self) -> None:
        device = torch.cuda.current_device() if self.backend_type == BackendType.NCCL else None
        metadata = {"pp_rank": 0, "pp_size": 1, "is_pp_src_rank": True} if self.role == ACTOR else {}
        client = CheckpointEngineClient(
            role=str(self.role),
            rank=0 if self.role == ACTOR else None,
            backend_type=self.backend_type,
            device_id=device,
            model_name=self.model_name,
            config=self.config,
            metadata=metadata,
        )
        self._loop = self._loop or _Loop(f"dcs-verl-{self.role}")
        self._loop.call(
            client.start(),
            self.config.coordinator.request_timeout_seconds * 3 + self.config.heartbeat.timeout_seconds + 30,
        )
        self.client = client

    def _run(self, coro: Awaitable[T], timeout: float) -> T:
        assert self._loop is not None
        return self._loop.call(coro, timeout)

    async def _wait(self, coro: Awaitable[T]) -> T:
        assert self._loop is not None
        return await self._loop.wait(coro)


async def _entries(weights: Any) -> AsyncIterator[Any]:
    """verl hands a generator, sync or async (its `ensure_async_iterator` accepts both)."""
    if hasattr(weights, "__aiter__"):
        async for entry in weights:
            yield entry
    else:
        for entry in weights:
            yield entry
