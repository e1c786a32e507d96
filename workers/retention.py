"""Retention after a commit: apply the run's policy, sparing steps the ledger still has in flight."""

from __future__ import annotations

from pathlib import Path

from dcs_tasks.checkpoint.models import RetentionRequest
from dcs_tasks.checkpoint.retention import apply_retention
from workers.persist import ledger


def retain(req: RetentionRequest) -> list[int]:
    in_flight = ledger().in_flight_steps(req.run)
    return apply_retention(Path(req.run_dir), req.policy, in_flight)
