"""Weight-meta entries carry their update's version: with PP = 2 and back-to-back updates, one stage's bucket of
update k+1 is never taken into update k (real processes, the real coordinator)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dcs_tasks.config import DCSConfig
from tests.distributed.sync_stack import sync_stack
from tests.helpers.preloaded import python_module
from tests.helpers.procs import child_env

pytestmark = [pytest.mark.integration, pytest.mark.distributed, pytest.mark.slow]

UPDATES = 3


def test_pp2_back_to_back_updates_commit_each_version_whole(dcs_config: DCSConfig, tmp_path: Path) -> None:
    """Stage 0 pushes its updates back to back, stage 1 waits 0.4 s before each of its own and the receiver starts
    every weight-meta log read 0.3 s late, so the log holds stage 0's buckets of update k+1 (and k+2) before
    stage 1's end marker of update k. Every version the receiver commits must be exactly that update of both
    stages: before versioned entries, update k took stage 0's buckets of k+1 and ended at stage 0's second end
    marker."""
    config = dcs_config.model_copy(update={"bucket_size_bytes": 2048, "comm_timeout_seconds": 30.0})
    nodes = [("actor", 0, 0, 0.0), ("actor", 1, 1, 0.4), ("actor_fwd", 0, 0, 0.0)]
    with sync_stack(config, tmp_path) as stack:
        procs = []
        for role, rank, pp_rank, delay in nodes:
            extra = ["--slow-log-reads", "0.3"] if role == "actor_fwd" else ["--update-delay", str(delay)]
            args = [
                *extra,
                "--role",
                role,
                "--rank",
                str(rank),
                "--pp-rank",
                str(pp_rank),
                "--pp-size",
                "2",
                "--rollouts",
                str(UPDATES),
                "--back-to-back",
                "--expect",
                "actor=2,actor_fwd=1",
                "--out",
                str(tmp_path / f"{role}{rank}.json"),
            ]
            log = tmp_path / f"{role}{rank}.log"
            procs.append(python_module("tests.distributed.fwd_ref_node", *args, log=log, env=child_env(stack.config)))
        try:
            codes = [p.wait(timeout=120) for p in procs]
        finally:
            for p in procs:
                p.kill()
        logs = {f"{r}{k}": (tmp_path / f"{r}{k}.log").read_text()[-3000:] for r, k, _, _ in nodes}
        assert codes == [0, 0, 0], logs
        results = {f"{r}{k}": json.loads((tmp_path / f"{r}{k}.json").read_text()) for r, k, _, _ in nodes}

    for update in map(str, range(1, UPDATES + 1)):
        both = {**results["actor0"][update]["digest"], **results["actor1"][update]["digest"]}
        assert results["actor_fwd0"][update] == {"version": int(update), "digest": both}, f"update {update}"
