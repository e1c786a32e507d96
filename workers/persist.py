"""The `dcs.ckpt.persist` task's work: `dcs_tasks.checkpoint.persisting` with this worker's `Runtime` (its config,
Redis and keys) as context."""

from __future__ import annotations

from dcs_tasks.checkpoint import persisting
from dcs_tasks.checkpoint.store.ledger.stepledger import StepLedger, Verdict
from dcs_tasks.checkpoint.store.payloads import PersistRequest
from workers.runtime import runtime


def ledger() -> StepLedger:
    return persisting.ledger(runtime())


def persist(req: PersistRequest, task_id: str) -> Verdict:
    """Write `req`'s file if this task may; returns COMMIT when this call completed the step's files."""
    return persisting.persist(runtime(), req, task_id)


def remove_partial_step_at(step_dir: object, run: str, step: int) -> None:
    """Remove a failed save's partial step, only when `step_dir` is trusted (else nothing is touched)."""
    persisting.remove_partial_step_at(runtime(), step_dir, run, step)
