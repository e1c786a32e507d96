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
import io
import re
import threading
import uuid
import weakref
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard._utils import narrow_tensor_by_index
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
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from dcs_tasks.checkpoint import replicas
from dcs_tasks.checkpoint.checkpointer import Checkpointer
from dcs_tasks.checkpoint.restore.sharded import StepShards
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


class DCSStorageWriter(StorageWriter):
    """A DCP `StorageWriter` that saves each rank's part as a committed DCS step (see the module doc).

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
        for item in plan.items:  # refused before anything is staged or written
            data = item.tensor_data
            if data is None:
                continue
            try:
                checkpoint_code(data.properties.dtype, item.index.fqn)
            except UnsupportedDtype as exc:
                raise UnstorableItem(item.index.fqn, str(exc)) from exc
            if len(data.size) > MAX_NDIM:
                raise UnstorableItem(item.index.fqn, f"{len(data.size)} dimensions, more than {MAX_NDIM}")
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        try:
            results = self._write(plan, planner)
        except BaseException:
            with contextlib.suppress(Exception):  # the save's own error is the one to see
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
    def _write(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        assert self.step is not None
        if self._ckpt is None:  # made here, not at set-up: a plan refused earlier leaves nothing to close
            self._ckpt = Checkpointer(
                self.run, self.config, celery_app=self._app, rank=self._rank, world_size=self._world
            )
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
        record = {"format": FORMAT, "items": records, "planner_data": _mappings(self._planner_data)}
        metadata = {**self._metadata, DCP_KEY: record}
        with _lock_of(self._ckpt):
            try:
                pending = self._ckpt.save(flat, self.step, metadata=metadata)
            except StagingError as exc:
                if isinstance(exc, UnstorableItem):
                    raise
                raise UnstorableItem(_named_key(str(exc), flat), str(exc)) from exc
        limit = self.config.task.time_limit_seconds if self._timeout is None else self._timeout
        pending.wait(timeout=limit)
        return results


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
