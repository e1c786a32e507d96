"""torch Distributed Checkpoint (DCP) on DCS: DCP plans, DCS stores.

    dcp.save(state, storage_writer=DCSStorageWriter("run", step=100))
    dcp.async_save(state, storage_writer=DCSStorageWriter("run", step=100))
    dcp.load(state, storage_reader=DCSStorageReader("run"))          # the newest step every rank committed

Saving. Each rank's final DCP plan (after DCP's own deduplication of replicated tensors) becomes one DCS save
of that rank: `Checkpointer(run, rank=r, world_size=W).save(flat, step)`, so what lands is an ordinary committed
DCS step (safetensors files, checksums, manifest, `latest`) through whatever store the config names (files, S3,
the memory tier), persisted and committed by the host's `dcs worker` (or an `InlineCommitter`). `flat` holds one
entry per DCP write item: a whole tensor under its fully qualified name (so `Checkpointer.restore` of a
single-rank step gives the tensors by name), a chunk of a sharded tensor (a DTensor's or ShardedTensor's local
shard) under `<fqn>@<offsets>`, and a non-tensor value (DCP serialises it to bytes with `torch.save`) as a uint8
tensor of at most `MAX_BYTES_ITEM` bytes: a blob the step's checksums cover, never unpickled by DCS. DCP's
`Metadata` is not pickled: the chunks each rank wrote (fqn, offsets, sizes, global size, dtype) and DCP's
flattening map go into the rank's manifest as JSON (`metadata["dcp"]`), and the reader rebuilds `Metadata` from
the manifests of every rank. `write_data` returns once the rank's step is committed, so `dcp.save` returning
(and `async_save`'s future completing) means the step is durable on every rank.

Loading. `DCSStorageReader` picks the step (the asked one, or the newest every saving rank committed and whose
manifests read), rebuilds `Metadata` from its manifests, and serves DCP's read items from the files of the ranks
that hold them, each file read once and verified against its checksum. DCP's planner decides what each loading
rank needs, so a step saved at one world size loads at another (resharding as DCP does it).

Bad input: a value DCS cannot store (a dtype safetensors lacks, a byte item over the bound, a sparse or nested
tensor) raises `UnstorableItem` naming the key before anything is written; nothing is committed.

Not supported: DCP's `use_collectives=False` saves (one metadata per rank), DCP storage transforms (compression
of DCP's own format; the DCS config's compression applies instead), and peer pulls of the memory tier on load
(this host's memory copy, then storage, are read).
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import re
import threading
import uuid
import weakref
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import _create_write_items
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.distributed.tensor import DTensor
from torch.futures import Future

from dcs_tasks.checkpoint import replicas
from dcs_tasks.checkpoint.checkpointer import Checkpointer
from dcs_tasks.checkpoint.restore.sharded import StepShards
from dcs_tasks.checkpoint.save.staged import StagedState
from dcs_tasks.checkpoint.store.tiers import memdir, stepplaces
from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import CheckpointError, CorruptCheckpoint, StagingError, UnsupportedDtype
from dcs_tasks.interop.dcp_steps import (
    DCP_KEY,
    FORMAT,
    MAX_BYTES_ITEM,
    MAX_ITEMS,
    MAX_NDIM,
    NotADCPStep,
    StoredItem,
    metadata_of,
    open_step_at,
    read_items,
)
from dcs_tasks.storage import Location
from dcs_tasks.tensors import checkpoint_code, dtype_name

log = logging.getLogger(__name__)

CHECKPOINT_ID = re.compile(r"^dcs://(?P<run>[^/]+)(?:/(?P<step>\d+))?/?$")


class UnstorableItem(StagingError):
    """A value of the state DCP hands DCS cannot be stored; `key` is its fully qualified name. Nothing was
    committed."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"cannot store {key!r} through DCS: {reason}")
        self.key = key


def parse_checkpoint_id(checkpoint_id: str | Any) -> tuple[str, int | None]:
    """`dcs://<run>` or `dcs://<run>/<step>` -> (run, step); CheckpointError for anything else."""
    found = CHECKPOINT_ID.match(str(checkpoint_id))
    if found is None:
        raise CheckpointError(f"checkpoint_id {str(checkpoint_id)[:120]!r} is not dcs://<run>[/<step>]")
    step = found.group("step")
    return found.group("run"), None if step is None else int(step)


def _world() -> tuple[int, int]:
    """(rank, world size) of the default process group, (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# One save at a time per Checkpointer (it is not thread-safe; async_save runs writers on its own thread).
_LOCKS: weakref.WeakKeyDictionary[Checkpointer, threading.Lock] = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


def _lock_of(ckpt: Checkpointer) -> threading.Lock:
    with _LOCKS_GUARD:
        return _LOCKS.setdefault(ckpt, threading.Lock())


# --- saving -------------------------------------------------------------------------------------------------


def item_key(index: MetadataIndex, whole: bool) -> str:
    """The DCS name of one DCP item: its fqn for a whole tensor or a byte value, `<fqn>@<offsets>` for a chunk."""
    if whole or index.offset is None:
        return index.fqn
    return f"{index.fqn}@{','.join(str(int(o)) for o in index.offset)}"


def _is_whole(item: WriteItem) -> bool:
    data = item.tensor_data
    if data is None:
        return True
    return all(o == 0 for o in data.chunk.offsets) and tuple(data.chunk.sizes) == tuple(data.size)


def _record(item: WriteItem, key: str) -> dict[str, Any]:
    """The JSON the reader rebuilds DCP's metadata of this item from."""
    data = item.tensor_data
    if item.type == WriteItemType.BYTE_IO or data is None:
        return {"fqn": item.index.fqn, "key": key, "kind": "bytes"}
    return {
        "fqn": item.index.fqn,
        "key": key,
        "kind": "tensor",
        "offsets": [int(o) for o in data.chunk.offsets],
        "sizes": [int(s) for s in data.chunk.sizes],
        "size": [int(s) for s in data.size],
        "dtype": dtype_name(data.properties.dtype),
        "requires_grad": bool(data.properties.requires_grad),
    }


def _mappings(planner_data: Any) -> list[list[Any]]:
    """DCP's flattening map (fqn -> path of str keys and int indices) as JSON pairs; [] when absent."""
    if not isinstance(planner_data, Mapping):
        return []
    out: list[list[Any]] = []
    for fqn, path in planner_data.items():
        if isinstance(fqn, str) and isinstance(path, tuple | list) and all(isinstance(p, str | int) for p in path):
            out.append([fqn, list(path)])
    return out


class _Staged:
    """What `DCSStorageWriter.stage` copied for one `async_save`: the DCS staged copy, the DCS key of each DCP item
    (-> the staged tensor's name; byte items: their serialised bytes) and DCP's flattening map of the state."""

    def __init__(self, state: StagedState, names: dict[str, str], blobs: dict[str, bytes], mappings: Any) -> None:
        self.state = state
        self.names = names
        self.blobs = blobs
        self.mappings = mappings

    def matches(self, flat: Mapping[str, torch.Tensor]) -> bool:
        """Whether the items the final plan resolved to are exactly the staged ones (the same memory, the same
        bytes): then the staged copy is what commits."""
        if flat.keys() != self.names.keys() | self.blobs.keys():
            return False
        for key, value in flat.items():
            if key in self.blobs:
                if value.numpy().tobytes() != self.blobs[key]:
                    return False
                continue
            view = self.state.views[self.names[key]]
            same = (value.dtype, tuple(value.shape), value.stride()) == (view.dtype, tuple(view.shape), view.stride())
            if not same or (view.numel() and value.data_ptr() != view.data_ptr()):
                return False
        return True


class _NotStaged(Exception):
    """A state `DCSStorageWriter.stage` leaves to DCP's default stager (see its doc)."""


class DCSStorageWriter(StorageWriter, AsyncStager):
    """A DCP `StorageWriter` that saves each rank's part as a committed DCS step (see the module doc).

    It is also DCP's `AsyncStager`: `dcp.async_save(state, storage_writer=DCSStorageWriter(...))` stages through
    it (`stage`), copying the state into DCS's staging buffers at the call, and its `write_data` commits that copy
    without copying again (`Checkpointer.commit_staged`). One `async_save` at a time per writer.

    `run`: a run name (a `Checkpointer` is made for the save, with this process's rank and world size, and
    closed after it) or a `Checkpointer` the caller keeps across saves (faster: its staging buffers stay mapped;
    its rank and world size must be the process group's). `step`: the DCS step (also `checkpoint_id=
    "dcs://<run>/<step>"`). `config`, `celery_app`: as `Checkpointer`'s. `metadata`: JSON the step's manifest
    keeps beside DCP's record. `timeout`: seconds to wait for the commit (default `task_time_limit_seconds`)."""

    def __init__(
        self,
        run: str | Checkpointer,
        step: int | None = None,
        *,
        config: DCSConfig | None = None,
        celery_app: Any = None,
        metadata: Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> None:
        super().__init__()
        self._own = not isinstance(run, Checkpointer)
        self._ckpt: Checkpointer | None = None if isinstance(run, str) else run
        self.run = run if isinstance(run, str) else run.run
        self.step = step
        self.config = config if config is not None else (self._ckpt.config if self._ckpt else DCSConfig())
        self._app = celery_app
        self._metadata = dict(metadata or {})
        if DCP_KEY in self._metadata:
            raise CheckpointError(f"metadata key {DCP_KEY!r} is DCP's record; name yours otherwise")
        self._timeout = timeout
        self._planner_data: Any = None
        self._rank, self._world = 0, 1
        self.save_id = uuid.uuid4().hex
        self._staged: _Staged | None = None

    # DCP's AsyncStager protocol (dcp.async_save) ----------------------------------------------------------
    _synchronize_after_execute = False  # stage() returns once the copy is done: nothing to wait for after

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Copy `state_dict` into this rank's DCS staging buffer now (the stall of `async_save`, as DCS's
        `save` stall) and return DCP the staged state: the same items, each tensor over the staged copy and each
        other value a copy, flattened as DCP's planner flattens it. `write_data` then commits the staged copy
        when the final plan writes exactly the staged items (a rank whose replicated items DCP's deduplication
        gave to another rank copies the planned ones again on DCP's thread, then commits). States with
        ShardedTensors, DTensors this rank holds no part of, or no free staging buffer (policy skip) are staged
        by DCP's default stager instead. A value DCS cannot store raises `UnstorableItem` here."""
        self._drop_staged()
        try:
            staged_state, self._staged = self._stage(state_dict)
        except _NotStaged as why:
            log.debug("DCP's default stager stages this state: %s", why)
            stager = DefaultStager(StagingOptions(False, False, False, False))
            try:
                return stager.stage(state_dict)  # type: ignore[return-value]  # synchronous: a state dict
            finally:
                stager.close()
        return staged_state

    def synchronize_staging(self) -> None:
        """Nothing to wait for: `stage` returns once the copy is done."""

    def close(self) -> None:
        """Give back a staged copy no save wrote (a failed `async_save`), and this writer's own Checkpointer."""
        self._drop_staged()
        self._close_own()

    def _drop_staged(self) -> None:
        staged, self._staged = self._staged, None
        if staged is not None and staged.state.release():
            log.warning("dcs://%s/%s: a staged copy no save wrote was given back", self.run, self.step)

    def _checkpointer(self) -> Checkpointer:
        if self._ckpt is None:
            self._ckpt = Checkpointer(
                self.run, self.config, celery_app=self._app, rank=self._rank, world_size=self._world
            )
        return self._ckpt

    def _stage(self, state_dict: dict[str, Any]) -> tuple[dict[str, Any], _Staged]:
        flat_state, mappings = flatten_state_dict(state_dict)
        keys, sources, blobs = _items_of(flat_state)
        if len(keys) > MAX_ITEMS:
            raise CheckpointError(f"{len(keys)} items on one rank, more than {MAX_ITEMS}")
        rank, world = _world()
        self._rank, self._world = rank, world
        ckpt = self._checkpointer()
        flat: dict[str, torch.Tensor] = {**sources}
        for key, raw in blobs.items():
            flat[key] = (
                torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
            )
        with _lock_of(ckpt):
            try:
                state = ckpt.stage(flat)
            except StagingError as exc:
                if isinstance(exc, UnstorableItem):
                    raise
                raise UnstorableItem(_named_key(str(exc), flat), str(exc)) from exc
        if state is None:
            raise _NotStaged("every staging buffer is in flight (staging_policy skip)")
        names = _names_of(sources, state.views)
        staged_state: dict[str, Any] = {}
        for fqn, obj in flat_state.items():
            key = keys[fqn]
            if key in blobs:
                staged_state[fqn] = copy.deepcopy(obj)  # the value at the call (DCP serialises it again, later)
                continue
            view = state.views[names[key]]
            if obj.requires_grad:
                view = view.detach().requires_grad_(True)
            staged_state[fqn] = (
                DTensor(view, obj._spec, requires_grad=obj.requires_grad) if isinstance(obj, DTensor) else view
            )
        return staged_state, _Staged(state, names, {k: v for k, v in blobs.items()}, mappings)

    # DCP's protocol -------------------------------------------------------------------------------------
    def reset(self, checkpoint_id: Any = None) -> None:
        self.save_id = uuid.uuid4().hex
        if checkpoint_id is None:
            return
        run, step = parse_checkpoint_id(checkpoint_id)
        if run != self.run:
            raise CheckpointError(f"checkpoint_id {checkpoint_id!r} names run {run!r}, this writer saves {self.run!r}")
        if step is not None:
            self.step = step

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return CHECKPOINT_ID.match(str(checkpoint_id)) is not None

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=f"dcs://{self.run}/{self.step}", save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        try:
            self._set_up(**kwargs)
        except BaseException:
            self._drop_staged()
            raise

    def _set_up(self, **kwargs: Any) -> None:
        if self.step is None:
            raise CheckpointError("DCSStorageWriter needs a step: DCSStorageWriter(run, step=N)")
        if kwargs.get("use_collectives") is False:
            raise CheckpointError("DCSStorageWriter needs DCP's collectives (use_collectives=True)")
        rank, world = _world()
        self._rank, self._world = int(kwargs.get("rank", rank)), world
        if not 0 <= self._rank < world:
            raise CheckpointError(f"DCP saves as rank {self._rank}, the process group has {world} ranks")
        if self._ckpt is not None and (self._ckpt.rank, self._ckpt.world_size) != (self._rank, world):
            raise CheckpointError(
                f"the Checkpointer given is rank {self._ckpt.rank} of {self._ckpt.world_size}, this process is "
                f"rank {self._rank} of {world}"
            )

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self._planner_data = plan.planner_data
        try:
            for item in plan.items:  # refused before anything is staged or written
                _check_item(item)
        except BaseException:
            self._drop_staged()
            raise
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        staged, self._staged = self._staged, None
        try:
            results = self._write(plan, planner, staged)
        except BaseException:
            with contextlib.suppress(Exception):  # the save's own error is the one to see
                if staged is not None:
                    staged.state.release()
                self._close_own()
            raise
        self._close_own()
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def _close_own(self) -> None:
        if self._own and self._ckpt is not None:
            ckpt, self._ckpt = self._ckpt, None
            ckpt.close()

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Nothing left to do: every rank's step was committed before its `write_data` returned, and DCP's
        metadata is in the manifests."""

    # the save ---------------------------------------------------------------------------------------------
    def _write(self, plan: SavePlan, planner: SavePlanner, staged: _Staged | None) -> list[WriteResult]:
        assert self.step is not None
        ckpt = self._checkpointer()  # made here, not at set-up: a plan refused earlier leaves nothing to close
        flat: dict[str, torch.Tensor] = {}
        records: list[dict[str, Any]] = []
        results: list[WriteResult] = []
        for item in plan.items:
            key = item_key(item.index, _is_whole(item))
            if key in flat:
                raise UnstorableItem(item.index.fqn, f"two items of this rank's plan are both named {key!r}")
            value = _resolved(item, planner.resolve_data(item))
            flat[key] = value
            records.append(_record(item, key))
            results.append(
                WriteResult(index=item.index, size_in_bytes=value.numel() * value.element_size(), storage_data=key)
            )
        if len(records) > MAX_ITEMS:
            raise CheckpointError(f"{len(records)} items on one rank, more than {MAX_ITEMS}")
        planner_data = self._planner_data if staged is None else staged.mappings
        record = {"format": FORMAT, "items": records, "planner_data": _mappings(planner_data)}
        metadata = {**self._metadata, DCP_KEY: record}
        with _lock_of(ckpt):
            if staged is not None and staged.matches(flat):  # the copy made at the call commits, no second copy
                pending = ckpt.commit_staged(staged.state, self.step, metadata=metadata)
            else:
                if staged is not None:  # the final plan is not what was staged: copy what it names, then give back
                    flat = {key: value.clone() for key, value in flat.items()}
                    staged.state.release()
                try:
                    pending = ckpt.save(flat, self.step, metadata=metadata)
                except StagingError as exc:
                    if isinstance(exc, UnstorableItem):
                        raise
                    raise UnstorableItem(_named_key(str(exc), flat), str(exc)) from exc
        limit = self.config.task.time_limit_seconds if self._timeout is None else self._timeout
        pending.wait(timeout=limit)
        return results


def _items_of(flat_state: Mapping[str, Any]) -> tuple[dict[str, str], dict[str, torch.Tensor], dict[str, bytes]]:
    """(fqn -> DCS key, DCS key -> the tensor to stage, DCS key -> a byte item's serialised bytes) of a state
    flattened as DCP flattens it; _NotStaged for what DCP's default stager is left to stage."""
    sources: dict[str, torch.Tensor] = {}  # DCS key -> the tensor to copy
    blobs: dict[str, bytes] = {}
    keys: dict[str, str] = {}  # fqn -> DCS key
    for fqn, obj in flat_state.items():
        if isinstance(obj, ShardedTensor) or (hasattr(obj, "__create_write_items__") and not isinstance(obj, DTensor)):
            raise _NotStaged(f"{fqn!r} is a {type(obj).__name__}")
        if isinstance(obj, DTensor) and obj.device_mesh.get_coordinate() is None:
            raise _NotStaged(f"{fqn!r}: this rank holds no part of it")
        items = _create_write_items(fqn, obj)
        if len(items) != 1:
            raise _NotStaged(f"{fqn!r} is {len(items)} write items")
        item = items[0]
        _check_item(item)
        key = item_key(item.index, _is_whole(item))
        if key in sources or key in blobs:
            raise UnstorableItem(fqn, f"two items of this rank's state are both named {key!r}")
        keys[fqn] = key
        if item.type == WriteItemType.BYTE_IO:
            raw = io.BytesIO()
            torch.save(obj, raw)  # as DCP's planner serialises it (DefaultSavePlanner.transform_object)
            blobs[key] = _resolved(item, raw).numpy().tobytes()
        else:
            sources[key] = (obj.to_local() if isinstance(obj, DTensor) else obj).detach()
    return keys, sources, blobs


def _check_item(item: WriteItem) -> None:
    """UnstorableItem for a tensor item DCS cannot store (a dtype safetensors lacks, too many dimensions)."""
    data = item.tensor_data
    if data is None:
        return
    try:
        checkpoint_code(data.properties.dtype, item.index.fqn)
    except UnsupportedDtype as exc:
        raise UnstorableItem(item.index.fqn, str(exc)) from exc
    if len(data.size) > MAX_NDIM:
        raise UnstorableItem(item.index.fqn, f"{len(data.size)} dimensions, more than {MAX_NDIM}")


def _names_of(sources: Mapping[str, torch.Tensor], views: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """DCS key -> the name its staged copy has: its own, or, for a tensor tied to an earlier one (the same view of
    the same memory, staged once), that one's."""
    names: dict[str, str] = {}
    first: dict[tuple[Any, ...], str] = {}
    for key, t in sources.items():
        ident = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride()) if t.numel() else None
        if key in views:
            names[key] = key
            if ident is not None:
                first.setdefault(ident, key)
        elif ident is not None and ident in first:
            names[key] = first[ident]
        else:
            raise CheckpointError(f"{key!r} was not staged")
    return names


def _resolved(item: WriteItem, data: Any) -> torch.Tensor:
    """The tensor DCS stores for one item: the tensor itself, or a byte value's bytes as uint8."""
    fqn = item.index.fqn
    if item.type == WriteItemType.BYTE_IO:
        raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
        if len(raw) > MAX_BYTES_ITEM:
            raise UnstorableItem(fqn, f"its serialised value has {len(raw)} bytes, more than {MAX_BYTES_ITEM}")
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    if not isinstance(data, torch.Tensor):
        raise UnstorableItem(fqn, f"the planner resolved it to {type(data).__name__}, not a tensor")
    assert item.tensor_data is not None
    if tuple(data.shape) != tuple(item.tensor_data.chunk.sizes):
        raise UnstorableItem(fqn, f"shape {tuple(data.shape)} is not its chunk's {tuple(item.tensor_data.chunk.sizes)}")
    return data.detach()


def _named_key(message: str, flat: Mapping[str, Any]) -> str:
    """The item a StagingError of DCS's flattening names (it quotes the path, here the item's key)."""
    for key in flat:
        if f"'{key}'" in message:
            return key.split("@", 1)[0]
    return "<state>"


# --- loading ------------------------------------------------------------------------------------------------


class DCSStorageReader(StorageReader):
    """A DCP `StorageReader` over the steps `DCSStorageWriter` saved (see the module doc). `run`: the run name;
    `step`: a step, or None for the newest step every saving rank committed (also `checkpoint_id=
    "dcs://<run>[/<step>]"`); `config`: the DCS config naming the stores (default: from the environment).
    Every file read is verified against its checksum (CorruptCheckpoint names it)."""

    def __init__(self, run: str, step: int | None = None, *, config: DCSConfig | None = None) -> None:
        super().__init__()
        self.run = run
        self.step = step
        self.config = config or DCSConfig()
        self.load_id = uuid.uuid4().hex
        self._shards: StepShards | None = None
        self._storage: dict[MetadataIndex, StoredItem] = {}

    def reset(self, checkpoint_id: Any = None) -> None:
        self.load_id = uuid.uuid4().hex
        self._shards = None
        if checkpoint_id is None:
            return
        run, step = parse_checkpoint_id(checkpoint_id)
        self.run, self.step = run, step

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return CHECKPOINT_ID.match(str(checkpoint_id)) is not None

    @property
    def chosen_step(self) -> int | None:
        """The step `read_metadata` chose (None before)."""
        return None if self._shards is None else self._shards.step

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        self._shards = open_step(self.run, self.config, self.step)
        metadata = metadata_of(self._shards)
        metadata.storage_meta = StorageMeta(checkpoint_id=f"dcs://{self.run}/{self._shards.step}", load_id=self.load_id)
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not isinstance(metadata.storage_data, dict):
            raise CheckpointError("DCSStorageReader reads metadata from its own read_metadata only")
        self._storage = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if self._shards is None:
            self._shards = open_step(self.run, self.config, self.step)
        by_rank: dict[int, list[ReadItem]] = {}
        for req in plan.items:
            by_rank.setdefault(self._storage[req.storage_index].rank, []).append(req)
        for req, stored in read_items(self._shards, by_rank, lambda r: self._storage[r.storage_index]):
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(stored.numpy().tobytes()))
                continue
            part = narrow_tensor_by_index(stored, req.storage_offsets, req.lengths)
            target = planner.resolve_tensor(req).detach()
            if target.size() != part.size():
                raise CorruptCheckpoint(
                    f"step {self._shards.step}: {req.storage_index.fqn!r} read as {tuple(part.shape)}, "
                    f"the target needs {tuple(target.shape)}"
                )
            target.copy_(part)
            planner.commit_tensor(req, target)
        future: Future[None] = Future()
        future.set_result(None)
        return future


def open_step(run: str, config: DCSConfig, step: int | None) -> StepShards:
    """`open_step_at` over the run's copies as `Checkpointer.restore` reads them: this host's memory tier (when
    on), the primary, the replica (when `replica_dir` is set)."""
    stores = replicas.run_roots(config, run)
    roots: list[tuple[str, Location]] = list(stores)
    if memdir.enabled(config):
        roots.insert(0, (stepplaces.MEMORY, memdir.memory_root(config) / run))
    return open_step_at(run, roots, stores[0][1], step)


__all__ = [
    "DCSStorageReader",
    "DCSStorageWriter",
    "NotADCPStep",
    "UnstorableItem",
    "open_step",
    "parse_checkpoint_id",
]
