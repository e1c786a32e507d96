"""Handles returned by `Checkpointer.save` and the result types of the checkpoint API."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import redis

from dcs_tasks.checkpoint.format.layout import MANIFEST_NAME, Manifest
from dcs_tasks.checkpoint.restore.reader import load_manifest
from dcs_tasks.checkpoint.store.ledger.stepledger import StepLedger, StepStatus
from dcs_tasks.errors import CheckpointFailed, CorruptCheckpoint, CorruptLedger, DCSTimeoutError
from dcs_tasks.metrics import get_metrics
from dcs_tasks.storage import Location, store_of

if TYPE_CHECKING:  # a reader of checkpoints (`dcs ckpt`) needs no staging, so no torch
    from dcs_tasks.checkpoint.save.staging import BufferLease

log = logging.getLogger(__name__)
POLL_MIN_SECONDS = 0.005
POLL_MAX_SECONDS = 0.05
FINAL = (StepStatus.COMMITTED, StepStatus.FAILED)


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint."""

    run: str
    step: int
    path: Location
    nbytes: int
    files: int
    created_at: float
    metadata: dict[str, Any] = field(default_factory=dict)
    removed: bool = False
    """True when the step committed but its directory has been removed since (retention's keep_last /
    keep_every, or an operator): the other fields are what was committed, read from the step's ledger."""

    @classmethod
    def of(cls, manifest: Manifest, step_dir: Location) -> CheckpointInfo:
        return cls(
            manifest.run,
            manifest.step,
            step_dir,
            manifest.total_bytes,
            len(manifest.files),
            manifest.created_at,
            dict(manifest.metadata),
        )


@dataclass(frozen=True)
class RestoredCheckpoint:
    """What `restore` returns: the step, the rebuilt state and the user metadata given to `save`, and which
    copy it came from: `location` "primary" (under `checkpoint_dir`) or "replica" (under `replica_dir`),
    `path` the step directory read (multi-rank: the run directory holding the ranks' step directories)."""

    step: int
    state: Any
    metadata: dict[str, Any]
    location: str = "primary"
    path: Location | None = None


class PendingCheckpoint:
    """A save in flight. `stall_seconds` is what the trainer paid; `wait()` blocks until commit.

    Polls the step's Redis ledger. Holds the save's staging-buffer `lease` and ends it once every persist task
    of the save has reached a final outcome (the buffer may then be reused); a lease ends only once, whoever
    ends it (this handle, the dispatcher when no task went out, or the checkpointer's close).
    """

    def __init__(
        self,
        run: str,
        step: int,
        *,
        ledger: StepLedger | None,
        step_dir: Location,
        stall_seconds: float,
        skipped: bool = False,
        lease: BufferLease | None = None,
        dispatch: Future[None] | None = None,
        staged: threading.Event | None = None,
        storage_dir: Location | None = None,
        failed: str = "",
    ) -> None:
        self.run = run
        self.step = step
        self.step_dir = step_dir
        # a memory-tier step commits in `step_dir` (this host's memory) and may reach storage later: where its
        # manifest is read from once it left memory
        self.storage_dir = storage_dir
        self.stall_seconds = stall_seconds
        self.skipped = skipped
        self._ledger = ledger
        self._lease = lease
        self._dispatch = dispatch
        self._staged = staged
        # `failed`: the save failed in the trainer before any task went out (storage unreachable): final at once
        self._status: StepStatus | None = StepStatus.FAILED if failed else None
        self._reason = failed
        self.failure_raised = False  # wait() raised this save's failure: the caller knows (a checkpointer says no more)
        if ledger is not None and not skipped and not failed:
            IN_FLIGHT.add(self)

    def __repr__(self) -> str:
        return f"PendingCheckpoint(run={self.run!r}, step={self.step}, status={self._status}, skipped={self.skipped})"

    @property
    def released(self) -> bool:
        """True once every persist task finished, so the staging buffer was handed back."""
        return self._lease is None or self._lease.released

    def poll(self) -> StepStatus | None:
        """Refresh from Redis (one round trip); returns the step status. Releases the buffer when allowed."""
        if self._ledger is None:
            return self._status
        if self._status in FINAL and self.released:
            return self._status
        status, finished, nfiles, reason = self._ledger.progress(self.run, self.step)
        all_finished = bool(nfiles) and finished >= nfiles
        # tasks never sent never finish: once such a save is FAILED the sent ones stop at their claim (one
        # already writing may still read the buffer, into a file of this failed step that never commits)
        unsent = status is StepStatus.FAILED and self._dispatch_error() is not None
        if self._lease is not None and (all_finished or unsent):
            self._lease.release()  # a no-op when it already ended
        self._status, self._reason = status, reason
        if status in FINAL:
            IN_FLIGHT.discard(self)
        return status

    @property
    def staged(self) -> bool:
        """True once the saved tensors were copied into staging (at once unless `save(overlap=True)`): from then
        on they may change."""
        return self._staged is None or self._staged.is_set()

    def wait_staged(self, timeout: float | None = 60.0) -> None:
        """Block until `staged` (a failed copy counts: `wait()` then raises). DCSTimeoutError after `timeout`."""
        if self._staged is not None and not self._staged.wait(timeout):
            raise DCSTimeoutError(f"step {self.step} of run {self.run!r} not copied into staging after {timeout}s")

    def failure(self) -> tuple[str, BaseException | None] | None:
        """Why this save failed, as last seen (no Redis round trip; `poll()` first): (the worker's reason, or the
        trainer's own error with its exception), None while it has not failed."""
        error = self._dispatch_error()
        if error is not None:
            return str(error), error
        if self._status is StepStatus.FAILED:
            return self._reason, None
        return None

    def done(self) -> bool:
        """True once the step is committed or failed (or the save was skipped)."""
        if self.skipped or self._dispatch_error() is not None:
            return True
        try:
            return self.poll() in (StepStatus.COMMITTED, StepStatus.FAILED)
        except redis.RedisError:
            return False

    def wait(self, timeout: float | None = 60.0) -> CheckpointInfo:
        """Block until committed. Raises CheckpointFailed (with the worker's reason, or when the save was
        skipped under policy skip) and DCSTimeoutError after `timeout` seconds (None: wait forever)."""
        if self.skipped:
            raise CheckpointFailed(f"step {self.step} of run {self.run!r} was skipped: every staging buffer was busy")
        if self._ledger is None and self._status is StepStatus.FAILED:
            self.failure_raised = True
            raise CheckpointFailed(f"checkpoint step {self.step} of run {self.run!r} failed: {self._reason}")
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = POLL_MIN_SECONDS
        woken = False  # the last nap ended on the step's end token (StepLedger.nap)
        while True:
            error = self._dispatch_error()
            if error is not None:
                self.failure_raised = True
                raise CheckpointFailed(str(error)) from error
            status = self._poll_quietly()
            if woken and status in FINAL and self._ledger is not None:
                self._ledger.pass_on_end(self.run, self.step)  # the token goes on to this step's other waiters
            if status is StepStatus.COMMITTED and self.released:
                return self._info()
            if status is StepStatus.FAILED:
                self.failure_raised = True
                raise CheckpointFailed(f"checkpoint step {self.step} of run {self.run!r} failed: {self._reason}")
            if deadline is not None and time.monotonic() >= deadline:
                raise DCSTimeoutError(
                    f"checkpoint step {self.step} of run {self.run!r} not committed after {timeout}s "
                    f"(status {status.value if status else 'unknown'}); is a `dcs worker` running on this host?"
                )
            woken = self._nap(delay if deadline is None else min(delay, max(deadline - time.monotonic(), 0.0)))
            delay = min(delay * 2, POLL_MAX_SECONDS)

    def _nap(self, seconds: float) -> bool:
        """Sleep between polls, as long as before, but woken as the step ends (`StepLedger.nap`)."""
        if self._ledger is None:
            time.sleep(seconds)
            return False
        return self._ledger.nap(self.run, self.step, seconds)

    def _dispatch_error(self) -> BaseException | None:
        if self._dispatch is None or not self._dispatch.done():
            return None
        error = self._dispatch.exception()
        if error is not None:  # its tasks were not all sent: the save failed, nothing is in flight any more
            IN_FLIGHT.discard(self)
        return error

    def observed_final(self) -> bool:
        """Read-only check (any thread, one Redis round trip): has this save committed or failed? Unlike
        `poll()` it never hands the staging buffer back, so a metrics scrape may call it."""
        if self._dispatch_error() is not None or self._ledger is None:
            return True
        try:
            return self._ledger.progress(self.run, self.step)[0] in FINAL
        except (redis.RedisError, CorruptLedger):  # a scrape must not fail: `wait()` raises a corrupt record
            return False

    def _poll_quietly(self) -> StepStatus | None:
        try:
            return self.poll()
        except redis.RedisError:  # Redis restarting: keep polling until the deadline
            return self._status

    def _info(self) -> CheckpointInfo:
        """The committed step's info from its manifest (a memory-tier step's: in memory, else in storage once it
        left memory); when the manifest is gone (retention deleted the step after its commit: it removes the
        manifest first), what the ledger recorded, with `removed`. A manifest that is there but does not read
        is damage: CorruptCheckpoint."""
        places = [self.step_dir] if self.storage_dir is None else [self.step_dir, self.storage_dir]
        missing: CorruptCheckpoint | None = None
        for place in places:
            try:
                return CheckpointInfo.of(load_manifest(place), place)
            except CorruptCheckpoint as exc:
                manifest = place / MANIFEST_NAME
                if store_of(manifest).exists(manifest):
                    raise
                missing = missing or exc
        info = self._committed_info()
        if info is None:
            assert missing is not None
            raise missing
        log.info("step %d of run %r committed and was removed since (retention)", self.step, self.run)
        return info

    def _committed_info(self) -> CheckpointInfo | None:
        """What this step's ledger says was committed (None when it does not say COMMITTED or has expired)."""
        if self._ledger is None:
            return None
        state = self._ledger.read(self.run, self.step)
        if state.status is not StepStatus.COMMITTED or not state.draft:
            return None
        draft = state.manifest_draft()
        files = list(state.files.values())
        return CheckpointInfo(
            draft.run,
            draft.step,
            self.step_dir,
            sum(f.size for f in files),
            len(files),
            draft.created_at,
            dict(draft.metadata),
            removed=True,
        )


class InFlightSaves:
    """The saves of this process not yet seen committed or failed; their count is `dcs_pending_operations`.

    A save enters when `Checkpointer.save` returns its handle and leaves as soon as anything observes its
    final status: `poll()`, `done()`, `wait()` (so the gauge is 0 once `wait()` returned), the checkpointer's
    own reaping, or `refresh()`, which a metrics endpoint calls before each scrape so the gauge is right at
    the moment it is read even if the trainer polls nothing. Thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._saves: dict[int, PendingCheckpoint] = {}

    def add(self, pending: PendingCheckpoint) -> None:
        with self._lock:
            self._saves[id(pending)] = pending
            self._publish()

    def discard(self, pending: PendingCheckpoint) -> None:
        with self._lock:
            if self._saves.pop(id(pending), None) is not None:
                self._publish()

    def refresh(self) -> int:
        """Drop the saves whose final status Redis now holds (read-only); returns how many remain."""
        with self._lock:
            saves = list(self._saves.values())
        for pending in saves:
            if pending.observed_final():
                self.discard(pending)
        return len(self)

    def __len__(self) -> int:
        with self._lock:
            return len(self._saves)

    def _publish(self) -> None:
        get_metrics().pending_operations.set(len(self._saves))


IN_FLIGHT = InFlightSaves()
