"""Handles returned by `Checkpointer.save` and the result types of the checkpoint API."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from dcs_tasks.checkpoint.format import Manifest
from dcs_tasks.checkpoint.ledger import StepLedger, StepStatus
from dcs_tasks.checkpoint.reader import load_manifest
from dcs_tasks.errors import CheckpointFailed, DCSTimeoutError

POLL_MIN_SECONDS = 0.005
POLL_MAX_SECONDS = 0.05


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint."""

    run: str
    step: int
    path: Path
    nbytes: int
    files: int
    created_at: float
    metadata: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, manifest: Manifest, step_dir: Path) -> CheckpointInfo:
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
    """What `restore` returns: the step, the rebuilt state and the user metadata given to `save`."""

    step: int
    state: Any
    metadata: dict[str, Any]


class PendingCheckpoint:
    """A save in flight. `stall_seconds` is what the trainer paid; `wait()` blocks until commit.

    Polls the step's Redis ledger. `on_finished` is called once, when every persist task of the save has
    reached a final outcome (the staging buffer may then be reused).
    """

    def __init__(
        self,
        run: str,
        step: int,
        *,
        ledger: StepLedger | None,
        step_dir: Path,
        stall_seconds: float,
        skipped: bool = False,
        on_finished: Callable[[], None] | None = None,
        dispatch: Future[None] | None = None,
    ) -> None:
        self.run = run
        self.step = step
        self.step_dir = step_dir
        self.stall_seconds = stall_seconds
        self.skipped = skipped
        self._ledger = ledger
        self._on_finished = on_finished
        self._dispatch = dispatch
        self._status: StepStatus | None = None
        self._reason = ""

    def __repr__(self) -> str:
        return f"PendingCheckpoint(run={self.run!r}, step={self.step}, status={self._status}, skipped={self.skipped})"

    @property
    def released(self) -> bool:
        """True once every persist task finished, so the staging buffer was handed back."""
        return self._on_finished is None

    def poll(self) -> StepStatus | None:
        """Refresh from Redis (one round trip); returns the step status. Releases the buffer when allowed."""
        if self._ledger is None:
            return self._status
        if self._status in (StepStatus.COMMITTED, StepStatus.FAILED) and self._on_finished is None:
            return self._status
        status, finished, nfiles, reason = self._ledger.progress(self.run, self.step)
        all_finished = bool(nfiles) and finished >= nfiles
        # tasks never sent never finish: once such a save is FAILED the sent ones stop at their claim (one
        # already writing may still read the buffer, into a file of this failed step that never commits)
        unsent = status is StepStatus.FAILED and self._dispatch_error() is not None
        if self._on_finished is not None and (all_finished or unsent):
            callback, self._on_finished = self._on_finished, None
            callback()
        self._status, self._reason = status, reason
        return status

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
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = POLL_MIN_SECONDS
        while True:
            error = self._dispatch_error()
            if error is not None:
                raise CheckpointFailed(str(error)) from error
            status = self._poll_quietly()
            if status is StepStatus.COMMITTED and self._on_finished is None:
                return self._info()
            if status is StepStatus.FAILED:
                raise CheckpointFailed(f"checkpoint step {self.step} of run {self.run!r} failed: {self._reason}")
            if deadline is not None and time.monotonic() >= deadline:
                raise DCSTimeoutError(
                    f"checkpoint step {self.step} of run {self.run!r} not committed after {timeout}s "
                    f"(status {status.value if status else 'unknown'}); is a `dcs worker` running on this host?"
                )
            time.sleep(delay)
            delay = min(delay * 2, POLL_MAX_SECONDS)

    def _dispatch_error(self) -> BaseException | None:
        if self._dispatch is None or not self._dispatch.done():
            return None
        return self._dispatch.exception()

    def _poll_quietly(self) -> StepStatus | None:
        try:
            return self.poll()
        except redis.RedisError:  # Redis restarting: keep polling until the deadline
            return self._status

    def _info(self) -> CheckpointInfo:
        return CheckpointInfo.of(load_manifest(self.step_dir), self.step_dir)
