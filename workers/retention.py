"""Retention after a commit: apply the run's policy, sparing steps the ledger still has in flight. The run
directory must be the run's own under this worker's checkpoint root or replica root (`workers.trust`), else
UntrustedPath. (The replicate task applies the policy to the replica run directory itself, after each copy.)"""

from __future__ import annotations

from dcs_tasks.checkpoint.models import RetentionRequest
from dcs_tasks.checkpoint.retention import apply_retention
from workers.persist import ledger
from workers.runtime import runtime
from workers.trust import trusted_run_dir


def retain(req: RetentionRequest) -> list[int]:
    run_dir = trusted_run_dir(req.run_dir, req.run, runtime().config, replica=True)
    in_flight = ledger().in_flight_steps(req.run)
    return apply_retention(run_dir, req.policy, in_flight)
