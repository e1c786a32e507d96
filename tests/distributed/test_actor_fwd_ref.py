"""actor (PP=2, two source ranks) -> actor_fwd + reference, each a real process, through the real coordinator."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dcs_tasks.config import DCSConfig
from tests.distributed.sync_stack import sync_stack
from tests.helpers.preloaded import python_module
from tests.helpers.procs import child_env

pytestmark = [pytest.mark.integration, pytest.mark.distributed, pytest.mark.slow]


def test_pp2_actors_update_actor_fwd_every_rollout_and_reference_on_its_interval(
    dcs_config: DCSConfig, tmp_path: Path
) -> None:
    config = dcs_config.model_copy(
        update={
            "bucket_size_bytes": 2048,
            "ref_update_interval": 2,
            "comm_timeout_seconds": 30.0,
            "group_init_timeout_seconds": 30.0,
        }
    )
    nodes = [("actor", 0, 0), ("actor", 1, 1), ("actor_fwd", 0, 0), ("reference", 0, 0)]
    with sync_stack(config, tmp_path) as stack:
        procs = []
        for role, rank, pp_rank in nodes:
            out = tmp_path / f"{role}{rank}.json"
            args = [
                "--role",
                role,
                "--rank",
                str(rank),
                "--pp-rank",
                str(pp_rank),
                "--pp-size",
                "2",
                "--rollouts",
                "3",
                "--expect",
                "actor=2,actor_fwd=1,reference=1",
                "--out",
                str(out),
            ]
            log = tmp_path / f"{role}{rank}.log"
            procs.append(python_module("tests.distributed.fwd_ref_node", *args, log=log, env=child_env(stack.config)))
        try:
            codes = [p.wait(timeout=150) for p in procs]
        finally:
            for p in procs:
                p.kill()
        logs = {f"{r}{k}": (tmp_path / f"{r}{k}.log").read_text()[-3000:] for r, k, _ in nodes}
        assert codes == [0, 0, 0, 0], logs
        results = {f"{r}{k}": json.loads((tmp_path / f"{r}{k}.json").read_text()) for r, k, _ in nodes}

    for rollout in ("1", "2", "3"):
        full = {**results["actor0"][rollout]["digest"], **results["actor1"][rollout]["digest"]}
        assert any(name.startswith("stage1.") for name in full)
        assert results["actor_fwd0"][rollout]["digest"] == full
        assert results["actor_fwd0"][rollout]["version"] == int(rollout)
    assert list(results["reference0"]) == ["2"]  # ref_update_interval=2
    assert results["reference0"]["2"]["digest"] == {
        **results["actor0"]["2"]["digest"],
        **results["actor1"]["2"]["digest"],
    }
    assert results["reference0"]["2"]["version"] == 1


@pytest.mark.parametrize("slow", [False, True], ids=["following", "reading-the-log-late"])
def test_actor_fwd_follows_back_to_back_updates_with_recv_weight_fully_async(
    dcs_config: DCSConfig, tmp_path: Path, slow: bool
) -> None:
    """Every update the receiver commits is whole, also when one answer of the weight-meta log holds the end of
    one update and the start of the next (`slow`: each log read starts 0.5 s late; an update used to take the
    next one's first bucket, and the next one then lacked that bucket's tensors)."""
    config = dcs_config.model_copy(update={"bucket_size_bytes": 2048, "comm_timeout_seconds": 30.0})
    nodes = [("actor", 0), ("actor_fwd", 0)]
    with sync_stack(config, tmp_path) as stack:
        procs = []
        for role, rank in nodes:
            extra = ["--slow-log-reads", "0.5"] if slow and role == "actor_fwd" else []
            args = [
                *extra,
                "--role",
                role,
                "--rank",
                str(rank),
                "--pp-size",
                "1",
                "--rollouts",
                "3",
                "--fully-async",
                "--expect",
                "actor=1,actor_fwd=1",
                "--out",
                str(tmp_path / f"{role}.json"),
            ]
            log = tmp_path / f"{role}.log"
            procs.append(python_module("tests.distributed.fwd_ref_node", *args, log=log, env=child_env(stack.config)))
        try:
            codes = [p.wait(timeout=120) for p in procs]
        finally:
            for p in procs:
                p.kill()
        assert codes == [0, 0], {r: (tmp_path / f"{r}.log").read_text()[-3000:] for r, _ in nodes}
    actor = json.loads((tmp_path / "actor.json").read_text())
    fwd = json.loads((tmp_path / "actor_fwd.json").read_text())
    assert fwd == actor == {"version": 3, "digest": actor["digest"]}
