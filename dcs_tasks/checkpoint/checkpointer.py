"""`Checkpointer`: the trainer-side API — save (stage + enqueue), restore, list.

save() = check a worker serves this host -> flatten -> take a staging buffer (policy block/skip) -> copy
tensors into it -> open the step in the Redis ledger -> return a `PendingCheckpoint`, while a dispatcher
thread sends one JSON persist task per file to this host's node queue (a failed send fails the pending
save with its reason). The workers write, checksum and commit. The stall the trainer pays is everything up
to that return (the copy dominates).

Multi-rank runs: every trainer rank makes its own `Checkpointer(run, rank=r, world_size=W)` and saves its
own part; a step counts once every rank committed it, and restore reshards to this checkpointer's world
size (see `dcs_tasks.checkpoint.restore.sharded`).

restore() and list() are a facade over `dcs_tasks.checkpoint.restore.restoring` (which step, which copy, one plan for
every kind of read); this class adds the memory tier's peer pulls, the replicas fallback and the load metric.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import redis
import torch
from celery import Celery

from dcs_tasks import hostdirs
from dcs_tasks.celery_app import make_celery
from dcs_tasks.checkpoint import agreement, dispatch, exiting, failures, replicas
from dcs_tasks.checkpoint.format.layout import (
    ChunkSums,
    Layout,
    draft_of,
    staging_prefix,
    step_dir_name,
)
from dcs_tasks.checkpoint.pending import CheckpointInfo, PendingCheckpoint, RestoredCheckpoint
from dcs_tasks.checkpoint.restore import reader, restoring, sharded
from dcs_tasks.checkpoint.restore.device import DeviceRestorer
from dcs_tasks.checkpoint.save import cuda
from dcs_tasks.checkpoint.save.copier import HostCopier
from dcs_tasks.checkpoint.save.staged import StagedState, views_of
from dcs_tasks.checkpoint.save.staging import BufferLease, Reservation, StagingBuffer, StagingPool, copy_into
from dcs_tasks.checkpoint.state import dtensor_meta
from dcs_tasks.checkpoint.state.structure import FlatState, flatten_state
from dcs_tasks.checkpoint.store.ledger.stepledger import StepLedger, StepStatus
from dcs_tasks.checkpoint.store.payloads import StepRef, validate_run_name, validate_step
from dcs_tasks.checkpoint.store.tiers import memdir, peerpulls, stepplaces
from dcs_tasks.checkpoint.telemetry import StagingGauges, record_load, record_stall
from dcs_tasks.config import DCSConfig, StagingPolicy
from dcs_tasks.errors import (
    CheckpointError,
    CheckpointFailed,
    SaveFailed,
    StagingError,
    StorageUnavailable,
)
from dcs_tasks.keys import Keys
from dcs_tasks.redisconn import sync_client
from dcs_tasks.storage import Location

if TYPE_CHECKING:
    from dcs_tasks.checkpoint.inline import InlineCommitter

log = logging.getLogger(__name__)


class Checkpointer:
    """Asynchronous checkpoints of one run. Not thread-safe: one trainer thread calls save/restore."""

    def __init__(
        self,
        run: str,
        config: DCSConfig | None = None,
        *,
        size_hint_bytes: int | None = None,
        celery_app: Celery | InlineCommitter | None = None,
        copy_threads: int | None = None,
        rank: int = 0,
        world_size: int = 1,
        device_restorer: DeviceRestorer | None = None,
        device_stager: cuda.DeviceStager | None = None,
    ) -> None:
        validate_run_name(run)
        validate_step(rank, "rank")
        if validate_step(world_size, "world_size") < 1 or not rank < world_size:
            raise CheckpointError(f"rank {rank} is not a rank of world size {world_size}")
        self.run = run
        self.rank = rank
        self.world_size = world_size
        self.config = config or DCSConfig()
        # both roots resolved once, here: a restore then touches nothing outside the run directories
        self._roots = replicas.run_roots(self.config, run)
        self.run_root = self._roots[0][1]
        # the memory tier (dcs_tasks.checkpoint.store.tiers): steps committed in memory_dir first, storage every Nth
        self._memory = memdir.enabled(self.config)
        self.memory_run_root = (memdir.memory_root(self.config, create=True) / run) if self._memory else None
        if self.memory_run_root is not None:
            self._roots = [(stepplaces.MEMORY, self.memory_run_root), *self._roots]
        self._last_durable = time.monotonic()
        # a single trainer keeps the plain layout; rank r of several writes <run>/rank-0000r/ as `<run>.rank-0000r`
        multi = world_size > 1
        self._shard_run = validate_run_name(sharded.shard_run_name(run, rank)) if multi else run
        self.run_dir = self.run_root / sharded.rank_dir_name(rank) if multi else self.run_root
        self.memory_run_dir = (
            None
            if self.memory_run_root is None
            else (self.memory_run_root / sharded.rank_dir_name(rank) if multi else self.memory_run_root)
        )
        self._keys = Keys(self.config.redis.namespace)
        self._redis = sync_client(self.config)  # a Sentinel URL follows the current master
        agreement.require_agreement(self.config, self._redis, self._keys, celery_app)
        self._ledger = StepLedger(self._redis, self._keys)
        self._app = celery_app or make_celery(self.config)
        self._pool = StagingPool(
            hostdirs.staging_dir(self.config, create=True),  # private to this uid (UnsafeHostDirectory)
            self.config.staging.buffers,
            prefix=staging_prefix(self.config.redis.namespace, self._shard_run),
        )
        self._copier = HostCopier(copy_threads)
        self._device = device_stager or cuda.DeviceStager()  # one side stream per device, reused by every save
        self._reserving: Future[None] | None = None  # a background registration of the staging buffers
        self.reservation: Reservation | None = None  # what the last reserve() took
        # restores into device tensors (restore.device: a ring of page-locked chunks on a side stream)
        self._device_restorer = device_restorer or DeviceRestorer()
        self._dispatcher = ThreadPoolExecutor(1, thread_name_prefix="dcs-dispatch")
        self._checks = ThreadPoolExecutor(1, thread_name_prefix="dcs-step-exists")  # beside the copy (save)
        self._layouts = dispatch.Layouts(self.config)  # one layout per state shape (incremental saves)
        self._pending: list[PendingCheckpoint] = []
        self._gauges = StagingGauges()
        self._closed: failures.ClosedSteps | None = None  # close()'s answer, once closed
        self._failures = failures.FailureLog(self.config)  # failed saves: logged, counted, raised (policy)
        self._noted: set[int] = set()  # ids of the saves in `_pending` whose failure `_failures` has
        self._flush_noted: set[int] = set()  # memory-tier steps whose failed copy to storage `_failures` has
        self._created_at = time.time()  # flush failures recorded before this checkpointer are not its saves'
        exiting.track(self, self._pool)  # staging files removed at exit and on SIGTERM, close() or not
        if size_hint_bytes:
            self._reserve_bytes(size_hint_bytes, background=True)

    # --- save -----------------------------------------------------------------------------------
    def save(
        self,
        state: Any,
        step: int,
        metadata: dict[str, Any] | None = None,
        timeout: float | None = None,
        sharding: Mapping[str, int] | None = None,
        durable: bool | None = None,
        overlap: bool = False,
    ) -> PendingCheckpoint:
        """Stage `state` and enqueue its persistence; returns once staged (with `async_io=False`, once
        committed, raising CheckpointFailed like `wait()`). `sharding`: flat tensor name ("model/w") ->
        the dimension this rank's part splits along (a restore at another world size reshards them; every
        other tensor is rank-local). Raises NoWorkerError when no worker serves this host, StagingError when
        no buffer frees up within `timeout` (policy block), CheckpointError when `step` is already committed
        or in flight, `step` is not an integer >= 0 or `sharding` does not fit the state; StagingError naming
        the state path when a value cannot be staged (DTensor and other wrapper subclasses, nested, sparse,
        quantized or meta tensors, dtypes safetensors lacks), before any tensor memory is read.

        DTensors (Shard/Replicate on a 1-D or 2-D mesh) need no `sharding=`: each rank stages its local
        shard with its place in the global tensor, and a shard several ranks hold is written by one of them
        (`dcs_tasks.checkpoint.restore.boxread`). Other placements raise `UnsupportedPlacement` naming the placement
        and the path; a DTensor mesh that does not place this process at `rank` raises CheckpointError.

        With the memory tier on (`memory_tier_bytes`), the step is committed in this host's memory first (the
        pending save completes then) and reaches storage too when `durable` is True, or, when None, when the
        step is a multiple of `storage_every_steps` or `storage_every_seconds` have passed since the last step
        sent there; a step that does not fit in the memory budget goes to storage only.

        `overlap=True`: return before the tensors are copied; the copy into staging runs in the background, beside
        the next forward and backward passes (which read the weights but do not change them), and the caller must
        not change the saved tensors until it is done: `pending.wait_staged()`, `wait_staged()` for every save,
        or `guard(optimizer)`, which makes each `optimizer.step()` wait for it first. The step is opened in the
        ledger before `save` returns (so a step already committed or in flight still raises here); a failed
        copy fails the save (`wait()` raises CheckpointFailed). CUDA tensors are copied on a side stream queued
        before `save` returns, after the work already queued on the current stream (`save.cuda`): the state at
        the call is what commits. DTensor states and `async_io=False` stage at once, as without `overlap`."""
        started = time.perf_counter()
        step = validate_step(step)
        self._reap()
        self._note_flush_failures()
        self._failures.report()  # SaveFailed for an earlier save that failed (policy raise)
        dispatch.require_worker(self._app, self._redis, self._keys, self.config)
        flat = self._flatten(state)
        if flat.dtensors and sharding:
            raise CheckpointError("a state holding DTensors records its own placements; save it without sharding=")
        dims = sharded.check_sharding(sharding or {}, flat.tensors)
        layout = self._layout(flat)
        lease = self._acquire(layout.nbytes, timeout)
        if lease is None:
            return PendingCheckpoint(
                self.run,
                step,
                ledger=None,
                step_dir=self._step_dir(step),
                stall_seconds=time.perf_counter() - started,
                skipped=True,
            )
        durable, in_memory = self._tier_of(step, layout.nbytes, durable)
        overlap = overlap and not flat.dtensors and self.config.checkpoint.async_io
        staged: threading.Event | None = None  # None: staged before save returns
        try:
            with lease:  # handed back if staging, the ledger or the hand-off to the dispatcher raises
                if overlap:  # the ledger first, the copy and the hand-off on the dispatcher thread
                    staged = threading.Event()
                    ref = self._begin(step, layout, flat, metadata or {}, dims, None, in_memory)
                    queued = self._queue_device_copies(lease.buffer, layout, flat)
                    sending = self._dispatcher.submit(
                        self._stage_and_send, ref, lease, layout, flat, durable, in_memory, staged, queued
                    )
                else:  # storage asked whether the step exists while the tensors are copied (a HEAD on S3)
                    asking = self._checks.submit(self._committed_dirs, step, in_memory)
                    self._stage(lease.buffer, layout, flat)
                    chunks = self._chunk_sums(lease.buffer, layout) if flat.dtensors else None
                    found = asking.result()
                    ref = self._begin(step, layout, flat, metadata or {}, dims, chunks, in_memory, found)
                    sending = self._dispatcher.submit(self._send, ref, lease, layout, durable, in_memory)
        except StorageUnavailable as exc:  # storage down (asked whether the step exists): this save only is lost
            return self._failed_at_once(step, exc, started)
        self._gauges.memory(self._pool.mapped_bytes())
        return self._sent(step, time.perf_counter() - started, lease, sending, layout, in_memory, staged)

    def _sent(
        self,
        step: int,
        stall: float,
        lease: BufferLease,
        sending: Future[None],
        layout: Layout,
        in_memory: bool,
        staged: threading.Event | None = None,
    ) -> PendingCheckpoint:
        """The handle of a save whose tasks went out (`save` and `commit_staged`): kept until it ends, its stall
        recorded; in synchronous mode waited for, so it is durable and committed before the caller gets it."""
        pending = PendingCheckpoint(
            self._shard_run,
            step,
            ledger=self._ledger,
            step_dir=self._target_dir(step, in_memory),
            stall_seconds=stall,
            lease=lease,
            dispatch=sending,
            staged=staged,
            storage_dir=self._step_dir(step) if in_memory else None,
        )
        self._pending.append(pending)
        self._gauges.pending(len(self._pending))
        record_stall(stall, layout.data_bytes)
        if not self.config.checkpoint.async_io:
            pending.wait(timeout=self.config.task.visibility_timeout_seconds)
        return pending

    def _failed_at_once(self, step: int, exc: StorageUnavailable, started: float) -> PendingCheckpoint:
        """A save storage could not take before any task went out: logged and counted as a storage outage (never
        raised, whatever `save_failure_policy`); its handle's `wait()` raises CheckpointFailed with the reason."""
        reason = f"storage unreachable before the save was sent: {type(exc).__name__}: {exc}"
        failure = failures.failure_of(self.config, self._shard_run, step, reason, exc)
        self._failures.add(failure)
        return PendingCheckpoint(
            self._shard_run,
            step,
            ledger=None,
            step_dir=self._step_dir(step),
            stall_seconds=time.perf_counter() - started,
            failed=failure.reason,
        )

    def wait_staged(self, timeout: float | None = None) -> None:
        """Block until every save of this checkpointer has copied its tensors (see `save(overlap=True)`); after
        this the saved tensors may change. Raises DCSTimeoutError after `timeout` seconds (None: default
        `task_time_limit_seconds`)."""
        limit = self.config.task.time_limit_seconds if timeout is None else timeout
        deadline = time.monotonic() + limit
        for pending in list(self._pending):
            pending.wait_staged(max(0.0, deadline - time.monotonic()))

    def guard(self, optimizer: torch.optim.Optimizer) -> Any:
        """Make every `optimizer.step()` first wait for the copies of overlapped saves (`save(overlap=True)`), so
        the weights and optimizer state it changes were copied first. Returns the hook's handle (`.remove()`)."""

        def wait(*_: object) -> None:
            self.wait_staged()

        return optimizer.register_step_pre_hook(wait)

    def _stage_and_send(
        self,
        ref: StepRef,
        lease: BufferLease,
        layout: Layout,
        flat: FlatState,
        durable: bool,
        in_memory: bool,
        staged: threading.Event,
        queued: cuda.Copies | BaseException | None = None,
    ) -> None:
        """An overlapped save's work on the dispatcher thread: the copy into staging (device states: waiting for
        the copies `save` queued, `queued`), then `_send`. A failed copy abandons the step in the ledger and ends
        the lease (no task went out)."""
        try:
            if isinstance(queued, BaseException):
                raise queued
            if queued is not None:
                queued.wait()
            else:
                self._stage(lease.buffer, layout, flat)
        except Exception as exc:
            reason = f"copying step {ref.step} into staging failed: {type(exc).__name__}: {exc}"
            with contextlib.suppress(redis.RedisError):
                self._ledger.abandon(ref.run, ref.step, ref.token, reason)
            lease.release()
            raise CheckpointFailed(reason) from exc
        finally:
            staged.set()
        self._send(ref, lease, layout, durable, in_memory)

    def stage(self, state: Any, timeout: float | None = None) -> StagedState | None:
        """The first half of `save()` alone: copy `state` into a staging buffer now (the stall `save` pays) and hold
        the buffer, with no step opened yet; `commit_staged(staged, step)` later makes that copy a step without
        copying again, and `staged.release()` gives the buffer back unsaved. For callers that learn the step's
        metadata after the state must be copied (`dcs_tasks.integrations.dcp`). `staged.views` are the staged
        tensors (read them only). Same errors as `save()`'s staging (StagingError naming the path of a value that
        cannot be staged, or when no buffer frees up within `timeout`); None under policy skip when every buffer
        is in flight. States holding DTensors are refused (save them with `save()`)."""
        started = time.perf_counter()
        flat = self._flatten(state)
        if flat.dtensors:
            raise CheckpointError("stage() takes plain tensors; save a state holding DTensors with save()")
        layout = self._layout(flat)
        lease = self._acquire(layout.nbytes, timeout)
        if lease is None:
            return None
        with lease:  # handed back if the copy raises
            self._stage(lease.buffer, layout, flat)
            assert lease.buffer.view is not None
            views = views_of(lease.buffer.view, layout, flat.tensors)
        self._gauges.memory(self._pool.mapped_bytes())
        return StagedState(lease, layout, flat, views, time.perf_counter() - started, owner=self._pool)

    def commit_staged(
        self,
        staged: StagedState,
        step: int,
        metadata: dict[str, Any] | None = None,
        durable: bool | None = None,
    ) -> PendingCheckpoint:
        """Make what `stage()` copied step `step` of this run: open the step and send its persist tasks, as `save()`
        does after its copy; returns the `PendingCheckpoint` (its `stall_seconds`: the staging copy's plus this
        call's). `metadata` and `durable` as `save()`'s. The staged copy is consumed either way: a commit that
        raises (CheckpointError for a step already committed or in flight, or one staged by another
        checkpointer or already consumed; NoWorkerError; SaveFailed under policy raise) gives its buffer back."""
        started = time.perf_counter()
        if staged.owner is not self._pool:
            raise CheckpointError("this staged state was staged by another Checkpointer")
        if not staged.take():
            raise CheckpointError("this staged state was already committed or released")
        lease, layout, flat = staged.lease, staged.layout, staged.flat
        try:
            with lease:  # handed back if anything below raises before the dispatcher owns it
                step = validate_step(step)
                self._reap()
                self._note_flush_failures()
                self._failures.report()
                dispatch.require_worker(self._app, self._redis, self._keys, self.config)
                durable, in_memory = self._tier_of(step, layout.nbytes, durable)
                ref = self._begin(step, layout, flat, metadata or {}, {}, None, in_memory)
                sending = self._dispatcher.submit(self._send, ref, lease, layout, durable, in_memory)
        except StorageUnavailable as exc:
            return self._failed_at_once(step, exc, started - staged.stall_seconds)
        return self._sent(step, staged.stall_seconds + time.perf_counter() - started, lease, sending, layout, in_memory)

    def _tier_of(self, step: int, nbytes: int, durable: bool | None) -> tuple[bool, bool]:
        """(the step reaches storage, the step is committed in memory first)."""
        if not self._memory:
            return True, False
        if durable is None:
            every = self.config.memory.storage_every_seconds
            durable = step % self.config.memory.storage_every_steps == 0 or (
                every > 0 and time.monotonic() - self._last_durable >= every
            )
        in_memory = memdir.fits(self.config, nbytes)
        if not in_memory:
            log.warning(
                "memory tier full (%d bytes budget): step %d of %r goes to storage only",
                self.config.memory.budget_bytes,
                step,
                self._shard_run,
            )
            durable = True
        if durable:
            self._last_durable = time.monotonic()
        return durable, in_memory

    @property
    def staging_buffers(self) -> list[StagingBuffer]:
        """This checkpointer's staging buffers, for inspection (path, capacity, `pinned`); do not write them."""
        return self._pool.buffers

    def reserve(self, state: Any, background: bool = False) -> Reservation:
        """Pre-allocate and pre-fault staging for `state`'s layout now (e.g. before the training loop) and, where
        CUDA is used (`pinned_memory`), register the buffers with it, so the first save does neither. With
        `background`, the registration runs on a thread (`Reservation.wait()`; a save waits for it first).
        Returns what it took (`Reservation`: seconds to allocate, seconds to register, when done)."""
        return self._reserve_bytes(self._layout(self._flatten(state)).nbytes, background)

    def _reserve_bytes(self, nbytes: int, background: bool) -> Reservation:
        self._wait_reserved()
        started = time.perf_counter()
        self._pool.reserve(nbytes)
        self._gauges.memory(self._pool.mapped_bytes())
        reservation = Reservation(nbytes, time.perf_counter() - started)
        self.reservation = reservation
        if self.config.staging.pinned_memory and self._device.available:
            buffers = [b for b in self._pool.buffers if b.capacity]
            if background:
                self._reserving = self._dispatcher.submit(reservation.register, self._device.pin, buffers)
            else:
                reservation.register(self._device.pin, buffers)
        else:
            reservation.unregistered()
        return reservation

    def _wait_reserved(self) -> None:
        reserving, self._reserving = self._reserving, None
        if reserving is not None:
            reserving.result()

    def _queue_device_copies(
        self, buf: StagingBuffer, layout: Layout, flat: FlatState
    ) -> cuda.Copies | BaseException | None:
        """An overlapped save of a device state: its copies queued now, at the call (None: not a device state;
        the exception when queueing failed, which fails this save only)."""
        if not self._device.handles(flat.tensors):
            return None
        try:
            self._wait_reserved()
            buf.write_headers(layout)
            return self._device.enqueue(buf, layout, flat.tensors, pinned=self.config.staging.pinned_memory)
        except Exception as exc:
            return exc

    def _flatten(self, state: Any) -> FlatState:
        """The flat state this rank writes: DTensor shards another rank writes are left out of `tensors`
        (`dtensors` still lists every DTensor of the state)."""
        flat = flatten_state(state)
        if not flat.dtensors:
            return flat
        dtensor_meta.check_ranks(flat.dtensors, self.rank, self.world_size)
        mine = dtensor_meta.owned(flat.dtensors, self.rank)
        return FlatState(
            tensors={n: t for n, t in flat.tensors.items() if n not in flat.dtensors or n in mine},
            structure=flat.structure,
            dtensors=flat.dtensors,
        )

    def _layout(self, flat: FlatState) -> Layout:
        return self._layouts.of(flat)

    def _acquire(self, nbytes: int, timeout: float | None) -> BufferLease | None:
        limit = self.config.task.time_limit_seconds if timeout is None else timeout
        deadline = time.monotonic() + limit
        delay = 0.001
        while True:
            self._reap()
            lease = self._pool.lease(nbytes)
            if lease is not None or self.config.staging.policy is StagingPolicy.SKIP:
                return lease
            if time.monotonic() >= deadline:
                raise StagingError(
                    f"all {self.config.staging.buffers} staging buffers are still being persisted after {limit}s"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.02)

    def _unfinished(self) -> tuple[int, ...]:
        """Steps saved by this checkpointer not yet committed or known failed (skipped saves never start)."""
        return tuple(sorted(p.step for p in self._pending if not p.skipped and id(p) not in self._noted))

    def _reap(self) -> None:
        for pending in list(self._pending):
            try:
                status = pending.poll()
            except redis.RedisError:
                continue
            self._note_failure(pending)
            if pending.released and status in (StepStatus.COMMITTED, StepStatus.FAILED):
                self._pending.remove(pending)
                self._noted.discard(id(pending))
        self._gauges.pending(len(self._pending))

    def _note_flush_failures(self) -> None:
        """Hand `_failures` the memory-tier steps of this checkpointer whose copy to storage failed for good (the
        worker records them in the ledger): committed in memory, they are not where `durable` asked them to be."""
        if self.memory_run_root is None:
            return
        try:
            found = self._ledger.flush_failures(self._shard_run, since=self._created_at)
        except redis.RedisError:
            return
        for step in sorted(found.keys() - self._flush_noted):
            self._flush_noted.add(step)
            reason = f"copying step {step} from memory to storage failed (it is in memory only): {found[step]}"
            self._failures.add(failures.failure_of(self.config, self._shard_run, step, reason))

    def _note_failure(self, pending: PendingCheckpoint) -> None:
        """Hand a save's failure, once, to `_failures` (which logs, counts and, by policy, raises it later)."""
        failure = pending.failure()
        if failure is None or id(pending) in self._noted:
            return
        self._noted.add(id(pending))
        reason, exc = failure
        self._failures.add(failures.failure_of(self.config, self._shard_run, pending.step, reason, exc), pending)

    def _stage(self, buf: StagingBuffer, layout: Layout, flat: FlatState) -> None:
        buf.write_headers(layout)
        if self._device.handles(flat.tensors):
            self._wait_reserved()
            self._device.copy_from_device(buf, layout, flat.tensors, pinned=self.config.staging.pinned_memory)
        else:
            copy_into(buf, layout, flat.tensors, copier=self._copier)

    @staticmethod
    def _chunk_sums(buf: StagingBuffer, layout: Layout) -> ChunkSums:
        """Per-chunk checksums of the staged tensors (DTensor states: restores read parts of files)."""
        assert buf.view is not None  # a buffer handed out by the pool is mapped
        return dtensor_meta.chunk_sums(buf.view, layout)

    def _begin(
        self,
        step: int,
        layout: Layout,
        flat: FlatState,
        metadata: dict[str, Any],
        dims: dict[str, int],
        chunks: ChunkSums | None,
        in_memory: bool = False,
        found: list[Location] | None = None,
    ) -> StepRef:
        draft = draft_of(
            self.run,
            step,
            layout,
            flat.structure,
            metadata,
            rank=self.rank,
            world_size=self.world_size,
            sharded_dims=dims,
            dtensors={n: m.entry() for n, m in flat.dtensors.items() if n in flat.tensors} if flat.dtensors else None,
            chunks=chunks,
        )
        step_dir = self._target_dir(step, in_memory)
        files = len(layout.files)
        return dispatch.open_step(
            self._ledger, self.config, self.run, self._shard_run, draft, files, step_dir, self._step_dir(step), found
        )

    def _committed_dirs(self, step: int, in_memory: bool) -> list[Location]:
        """`dispatch.committed_dirs` of the step's directories (`_begin`'s `found`)."""
        return dispatch.committed_dirs(self._target_dir(step, in_memory), self._step_dir(step))

    def _target_dir(self, step: int, in_memory: bool) -> Location:
        """Where the step is written first: this host's memory tier, or storage."""
        return self._memory_step_dir(step) if in_memory else self._step_dir(step)

    def _send(
        self, ref: StepRef, lease: BufferLease, layout: Layout, durable: bool = True, in_memory: bool = False
    ) -> None:
        """The dispatcher thread's work: `dispatch.send_persist_tasks` on this host's node queue."""
        dispatch.send_persist_tasks(self._app, self._ledger, self.config, ref, lease, layout, durable, in_memory)

    def _step_dir(self, step: int) -> Location:
        return self.run_dir / step_dir_name(step)

    def _memory_step_dir(self, step: int) -> Path:
        assert self.memory_run_dir is not None
        return self.memory_run_dir / step_dir_name(step)

    # --- read (dcs_tasks.checkpoint.restore.restoring) ---------------------------------------------------
    def list(self) -> list[CheckpointInfo]:
        """Committed checkpoints of this run, oldest first (newest last); with the memory tier on, the steps in this
        host's memory too (a step in both: its memory copy, the one restore reads first)."""
        dirs = (d for d in (self.memory_run_dir, self.run_dir) if d is not None)
        found = restoring.committed_manifests(dirs, lambda exc: log.warning("skipping unreadable checkpoint: %s", exc))
        return [CheckpointInfo.of(*found[step]) for step in sorted(found)]

    def restore(
        self, step: int | None = None, into: Any = None, verify: bool = True, strict: bool = True
    ) -> RestoredCheckpoint:
        """Load `step` (default: the newest committed step whose files verify, falling back to older ones
        with a warning). `into`: a state whose tensors are filled in place; DTensors in it receive their
        local shard, read from whichever saved shards overlap it (any mesh, any world size). `strict` (the
        default): `into` must hold exactly the checkpoint's tensors. `strict=False`: only the tensors `into`
        holds are read and filled, the rest of the checkpoint is ignored, and `into` itself is returned as
        the state. Either way a tensor `into` holds that the checkpoint lacks raises StateMismatch.
        Raises CheckpointNotFound, CorruptCheckpoint (explicit step), StateMismatch (naming the tensor).

        When the run was saved by several ranks, or this checkpointer has several, only steps every saving
        rank committed count, and the state is resharded for this rank (`dcs_tasks.checkpoint.restore.sharded`).
        Without `into`, a checkpoint's DTensors come back as whole plain tensors.

        With `replica_dir` set, steps are looked for under both roots: the newest step that verifies in
        either wins, its primary copy first and the replica when the primary is missing or corrupt (a
        warning names the corrupt copy); the result's `location` ("primary"/"replica") and `path` say which
        copy was read (`dcs_tasks.checkpoint.replicas`).

        With the memory tier on, this host's memory is read first (`location` "memory"); parts of the newest
        steps that only peer hosts' memory holds are fetched into this host's memory first (verified on arrival;
        `location` "peer:<host>" when the step read came from there), then storage."""
        pulled = self._pull_from_peers(step)
        found = restoring.find_steps(self.run, self._roots, self.run_root, self.world_size)

        def load(s: int) -> RestoredCheckpoint:
            copies = [
                (location, path, functools.partial(self._read, opener, into, verify, strict, self._source(location)))
                for location, path, opener in found.copies(s)
            ]
            return replicas.load_first_good(s, copies, heal=verify and found.plain)

        restored = found.choose(step, load)
        if restored.location == stepplaces.MEMORY and restored.step in pulled:
            restored = dataclasses.replace(restored, location=f"peer:{pulled[restored.step]}")
        return restored

    def _source(self, location: str) -> reader.Source:
        """How a copy at `location` is read: this host's memory is mapped, its sealed files not hashed again unless
        `memory_restore_verify` is "hash"; anything else as storage."""
        if location != stepplaces.MEMORY:
            return reader.Source.STORAGE
        return reader.Source.SEALED if self.config.memory.restore_verify == "seal" else reader.Source.MEMORY

    def _read(
        self, opener: restoring.Opener, into: Any, verify: bool, strict: bool, source: reader.Source
    ) -> RestoredCheckpoint:
        """One copy of a step, opened, planned and read for this rank (`source`: which copy, and so how)."""
        plan = restoring.plan(opener(), self.rank, self.world_size, into, strict)
        loaded = restoring.read(plan, verify, source, self._device_restorer)
        record_load(loaded.seconds, loaded.nbytes)
        return RestoredCheckpoint(step=loaded.step, state=loaded.state, metadata=loaded.metadata)

    def _pull_from_peers(self, step: int | None) -> dict[int, str]:
        if self.memory_run_root is None:
            return {}
        try:
            return peerpulls.pull_from_peers(self.config, self._redis, self._keys, self.run, step)
        except redis.RedisError as exc:
            log.warning("memory tier: places unreadable (%s): not looking at peers", exc)
            return {}

    # --- lifecycle ------------------------------------------------------------------------------
    def close(self, timeout: float | None = None) -> failures.ClosedSteps:
        """Wait for in-flight saves to be committed or failed and done with their staging buffers (at most
        `timeout` seconds, default `visibility_timeout_seconds`: the longest a sent persist task can take to come
        back after a worker crash), then free the buffers. So a `restore()` or `list()` after `close()` sees
        every save that committed. Returns a `ClosedSteps`: a tuple of the steps not final by then (`unfinished`;
        the staging files of those still being persisted are left in place for the workers, deleting them would
        lose the save, and an error names them), with `failed` (the steps whose save failed; `failures`: why)
        and `ok`. Under `save_failure_policy` "raise", a failure not raised yet (by `save()` or `pending.wait()`)
        raises SaveFailed once everything is closed. Closing again returns the same answer at once."""
        if self._closed is not None:
            return self._closed
        limit = self.config.task.visibility_timeout_seconds if timeout is None else timeout
        deadline = time.monotonic() + limit
        while (self._pool.in_flight() or self._unfinished()) and time.monotonic() < deadline:
            self._reap()
            time.sleep(0.02)
        self._dispatcher.shutdown(wait=True)
        self._checks.shutdown(wait=True)
        self._reap()
        self._note_flush_failures()
        unfinished = self._unfinished()
        if unfinished:
            log.error(
                "closing run %r with steps %s not committed after %gs; the staging files of those still being "
                "persisted stay for the workers (check them with `dcs ckpt list`)",
                self._shard_run,
                unfinished,
                limit,
            )
        self._pool.close(keep_in_flight=True)
        self._gauges.memory(0)
        self._gauges.pending(0)
        self._copier.close()
        self._redis.close()
        self._closed = failures.ClosedSteps(unfinished, self._failures.failed())
        self._failures.report()
        return self._closed

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
            return
        with contextlib.suppress(SaveFailed):  # logged when learned; the exception in flight stays the one raised
            self.close()
