"""The `dcs.ckpt.commit` task's work: `dcs_tasks.checkpoint.persisting.commit` with this worker's `Runtime` as
context (publish the manifest, move `latest`, mark the step COMMITTED)."""

from __future__ import annotations

from dcs_tasks.checkpoint import persisting
from dcs_tasks.checkpoint.store.ledger.stepledger import Verdict
from dcs_tasks.checkpoint.store.payloads import CommitRequest
from workers.runtime import runtime


def commit(req: CommitRequest, task_id: str) -> Verdict:
    """Returns WRITE when this call committed the step, otherwise why it did nothing."""
    return persisting.commit(runtime(), req, task_id)
