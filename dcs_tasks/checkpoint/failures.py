"""How a save that failed reaches the trainer: classified, scrubbed, logged, counted, and raised or warned.

A save fails on the worker (its persist or commit task fails for good and records the reason in the step's
ledger: `"persisting <file> failed: <ErrorType>: <message>"`), in the worker after a memory-tier commit (its copy
to storage gave up: `StepLedger.record_flush_failure`), or in the trainer (the tasks could not be sent, storage
could not be asked whether the step exists). The `Checkpointer` learns of it when it next looks at its
saves in flight (every `save()` and `close()`) and hands it to a `FailureLog`, which decides what the trainer
sees:

- storage could not be reached (`TRANSIENT`: `StorageUnavailable`, connection errors, timeouts): that save is
  lost, training goes on; a warning and `dcs_ckpt_save_failures_total{kind="storage_unavailable"}`, and the
  next save tries again.
- anything else (`UntrustedPath`, `StorageAccessDenied`, `StorageNotFound`, `StorageFull`, no space left on
  the memory directory, ...): retrying will not fix it; `{kind="failed"}` and, under `save_failure_policy`
  `raise` (the default), `SaveFailed` at the next `save()` or at `close()`; under `warn` an error line only.

Every failure, of either kind, is listed by `close()` (`ClosedSteps.failed`). Reasons are scrubbed of the
config's secrets and the AWS credentials in this process's environment, and bounded in length.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dcs_tasks.config import DCSConfig, SaveFailurePolicy, scrub_secrets
from dcs_tasks.errors import SaveFailed
from dcs_tasks.metrics import get_metrics

if TYPE_CHECKING:
    from dcs_tasks.checkpoint.pending import PendingCheckpoint

log = logging.getLogger(__name__)

TRANSIENT = frozenset(
    {
        "StorageUnavailable",
        "ConnectionError",
        "ConnectionRefusedError",
        "ConnectionResetError",
        "ConnectionAbortedError",
        "BrokenPipeError",
        "TimeoutError",
        "OperationalError",  # kombu: the broker (Redis) could not be reached to send the tasks
    }
)
"""Error types that say storage (or the way to it) was down, not that the setup is wrong."""
STORAGE_UNAVAILABLE = "storage_unavailable"
FAILED = "failed"
MAX_REASON_CHARS = 2000
MAX_KEPT = 1024  # failures a checkpointer remembers for close(); later ones are counted and logged only
_ERROR_NAME = re.compile(
    r"\b([A-Z][A-Za-z0-9_]*(?:Error|Exception|Exceeded|Unavailable|Denied|NotFound|Full|Path|"
    r"Payload|Failed|Corrupt[A-Za-z]*|Refused|Timeout)): "
)
_AWS_SECRETS = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")


@dataclass(frozen=True)
class SaveFailure:
    """One failed save: its step, the worker's reason (scrubbed), the error type named in it ("" when none is) and
    whether it is a storage outage (`transient`) rather than a setup the trainer must fix."""

    run: str
    step: int
    reason: str
    error_type: str
    transient: bool

    @property
    def kind(self) -> str:
        return STORAGE_UNAVAILABLE if self.transient else FAILED


def error_type_of(reason: str, exc: BaseException | None = None) -> str:
    """The error type a failure names: a transient one in `exc`'s chain of causes when given (the trainer's own
    failures: a broker or storage it could not reach), else the first `<ErrorType>: ` in `reason` (the worker's,
    as its task base formats them), else `exc`'s own type ("" when there is nothing to go by)."""
    chain: list[str] = []
    while exc is not None and len(chain) < 16:
        chain.append(type(exc).__name__)
        exc = exc.__cause__ or exc.__context__
    transient = [name for name in chain if name in TRANSIENT]
    if transient:
        return transient[0]
    found = _ERROR_NAME.search(reason)
    return found.group(1) if found else (chain[0] if chain else "")


def scrub(config: DCSConfig, text: str) -> str:
    """`text` with the config's secrets, URL credentials and this process's AWS secrets masked, bounded."""
    secrets = [*config.secret_values(), *(os.environ.get(name) for name in _AWS_SECRETS)]
    text = scrub_secrets(text, secrets)
    return text if len(text) <= MAX_REASON_CHARS else text[:MAX_REASON_CHARS] + "..."


def failure_of(config: DCSConfig, run: str, step: int, reason: str, exc: BaseException | None = None) -> SaveFailure:
    name = error_type_of(reason, exc)
    return SaveFailure(run, step, scrub(config, reason), name, name in TRANSIENT)


class FailureLog:
    """The failed saves of one checkpointer: each logged and counted once when learned, raised (policy `raise`)
    at the next `report()`, listed by `failed()`. Bounded: the first `MAX_KEPT` are kept for `close()`."""

    def __init__(self, config: DCSConfig) -> None:
        self._config = config
        self._kept: list[SaveFailure] = []
        self._unraised: list[tuple[SaveFailure, PendingCheckpoint | None]] = []
        self.count = 0

    def add(self, failure: SaveFailure, pending: PendingCheckpoint | None = None) -> None:
        """Log and count `failure` now; keep it for `report()` (unless `pending.wait()` raises it first: the caller
        knows then) and for `close()`."""
        self.count += 1
        get_metrics().save_failures.labels(kind=failure.kind).inc()
        if failure.transient:
            log.warning(
                "checkpoint step %d of run %r was not saved: storage unavailable (%s); training goes on and the "
                "next save tries again",
                failure.step,
                failure.run,
                failure.reason,
            )
        else:
            log.error("checkpoint step %d of run %r failed: %s", failure.step, failure.run, failure.reason)
        if len(self._kept) < MAX_KEPT:
            self._kept.append(failure)
        policy = SaveFailurePolicy(
            self._config.checkpoint.save_failure_policy
        )  # model_copy(update=...) does not validate
        if not failure.transient and policy is SaveFailurePolicy.RAISE:
            self._unraised.append((failure, pending))

    def report(self) -> None:
        """Raise SaveFailed for the failures not raised yet (policy `raise`; storage outages never raise). Each
        failure is raised once: the trainer that catches it and goes on is not told again."""
        unraised, self._unraised = self._unraised, []
        failures = [f for f, pending in unraised if pending is None or not pending.failure_raised]
        if failures:
            raise saved_failed(failures)

    def failed(self) -> tuple[SaveFailure, ...]:
        return tuple(self._kept)


def saved_failed(failures: Iterable[SaveFailure]) -> SaveFailed:
    """One SaveFailed naming every failure (the first one's step and error type as attributes)."""
    items = list(failures)
    first = items[0]
    lines = [f"step {f.step} of run {f.run!r}: {f.reason}" for f in items[:10]]
    more = f" (and {len(items) - 10} more)" if len(items) > 10 else ""
    fix = (
        "nothing of these steps was saved; fix the cause and save again (DCS_SAVE_FAILURE_POLICY=warn logs such "
        "failures instead of raising)"
    )
    message = f"{len(items)} checkpoint save(s) failed{more}:\n  " + "\n  ".join(lines) + f"\n{fix}"
    return SaveFailed(message, step=first.step, error_type=first.error_type, steps=tuple(f.step for f in items))


class ClosedSteps(tuple[int, ...]):
    """What `Checkpointer.close()` returns: a tuple of the steps not final by then (as before), with `unfinished`
    (the same steps), `failed` (steps whose save failed, in the order learned) and `failures` (their reasons)."""

    failures: tuple[SaveFailure, ...]

    def __new__(cls, unfinished: Iterable[int], failures: Iterable[SaveFailure] = ()) -> ClosedSteps:
        closed = super().__new__(cls, tuple(unfinished))
        closed.failures = tuple(failures)
        return closed

    @property
    def unfinished(self) -> tuple[int, ...]:
        return tuple(self)

    @property
    def failed(self) -> tuple[int, ...]:
        return tuple(f.step for f in self.failures)

    @property
    def ok(self) -> bool:
        """True when every save of the checkpointer committed (nothing failed, nothing unfinished)."""
        return not self and not self.failures
