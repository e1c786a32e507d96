"""Retention after a commit: apply the run's policy, sparing steps the ledger still has in flight and the files
they (and kept steps) refer to. The run directory must be the run's own under this worker's checkpoint root or
replica root (`workers.trust`), else UntrustedPath. (The replicate task applies the policy to the replica run
directory itself, after each copy.)"""

from __future__ import annotations

from dcs_tasks.checkpoint.store.payloads import RetentionRequest
from dcs_tasks.checkpoint.store.retention import apply_retention, in_flight_refs
from workers.objlocks import run_lock
from workers.persist import ledger
from workers.runtime import runtime
from workers.trust import trusted_run_dir


def retain(req: RetentionRequest) -> list[int]:
    run_dir = trusted_run_dir(req.run_dir, req.run, runtime().config, replica=True)
    book = ledger()
    return apply_retention(
        run_dir,
        req.policy,
        book.in_flight_steps(req.run),
        lambda: in_flight_refs(book, req.run),
        object_lock=lambda where: run_lock(where, "refs"),
    )
