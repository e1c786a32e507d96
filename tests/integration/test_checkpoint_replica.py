"""Replicas (`replica_dir`): each committed step is copied to the replica root, restore falls back to it when the
primary copy is missing or corrupt, retention prunes both, `dcs ckpt list` says where each step is (the worker's
code run by an in-process committer, `inline`), and an unwritable replica root fails only the replicate task (a
real `dcs worker`: its task result, log line, metric and trust checks of hostile payloads)."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from dcs_tasks import Checkpointer
from dcs_tasks.celery_app import TaskName, make_celery, node_queue
from dcs_tasks.checkpoint.format.layout import step_dir_name
from dcs_tasks.checkpoint.restore.reader import load_manifest, read_latest, step_dirs, verify_step
from dcs_tasks.checkpoint.store.ledger.stepledger import StepLedger
from dcs_tasks.config import DCSConfig
from dcs_tasks.keys import Keys
from dcs_tasks.redisconn import sync_client
from tests.checkpoint_support import (
    Inline,
    assert_same_state,
    ckpt_config,
    dcs_ckpt,
    training_state,
    wait_until,
)
from tests.helpers.ports import free_port
from tests.helpers.procs import WorkerProcess
from tests.integration.test_metrics_where_recorded import scrape, value
from workers.ckpt_tasks import replica_task_id

pytestmark = pytest.mark.integration

MiB = 1 << 20


def replica_config(base: DCSConfig, tmp_path: Path, **overrides: Any) -> DCSConfig:
    values: dict[str, Any] = {"replica_dir": tmp_path / "replica", "file_shard_bytes": MiB}
    return ckpt_config(base, tmp_path, **{**values, **overrides})


def replica_steps(config: DCSConfig, run: str) -> list[int]:
    assert config.checkpoint.replica_dir is not None
    return [s for s, _ in step_dirs(Path(config.checkpoint.replica_dir) / run)]


def primary_steps(config: DCSConfig, run: str) -> list[int]:
    return [s for s, _ in step_dirs(Path(config.checkpoint.dir) / run)]


def save_and_replicate(ckpt: Checkpointer, config: DCSConfig, state: Any, step: int) -> Path:
    """Save `step`, wait for its commit and its replica; the replica's step directory."""
    ckpt.save(state, step=step).wait(timeout=120)
    wait_until(lambda: step in replica_steps(config, ckpt.run), 120, f"the replica of step {step}")
    assert config.checkpoint.replica_dir is not None
    return Path(config.checkpoint.replica_dir) / ckpt.run / step_dir_name(step)


def listing(config: DCSConfig, run: str) -> dict[int, str]:
    """step -> the rest of its `dcs ckpt list` line."""
    done = dcs_ckpt(config, "list", "--run", run, "--replica-dir", str(config.checkpoint.replica_dir))
    assert done.returncode == 0, done.stderr
    return {int(line.split()[0]): line for line in done.stdout.splitlines() if line.strip()}


def test_primary_step_deleted_restores_bit_exact_from_the_replica(
    dcs_config: DCSConfig, tmp_path: Path, inline: Inline
) -> None:
    config = replica_config(dcs_config, tmp_path)
    committer = inline(config)
    first, second = training_state(seed=1, width=512), training_state(seed=2, width=512)  # ~2 MiB, 3 files
    try:
        with Checkpointer("rep", config, celery_app=committer) as ckpt:
            save_and_replicate(ckpt, config, first, 1)
            replica_dir = save_and_replicate(ckpt, config, second, 2)
            primary_dir = Path(config.checkpoint.dir) / "rep" / step_dir_name(2)
            manifest = load_manifest(replica_dir)
            verify_step(replica_dir, manifest)
            for f in manifest.files:  # the same bytes as the primary's, wherever each lies (step 1 too)
                assert f.stored_path(replica_dir).read_bytes() == f.stored_path(primary_dir).read_bytes()
            assert read_latest(replica_dir.parent) == 2
            lines = listing(config, "rep")
            assert "both" in lines[1] and "both" in lines[2] and "latest" in lines[2]

            shutil.rmtree(primary_dir)
            restored = ckpt.restore()
            assert restored.step == 2 and restored.location == "replica" and restored.path == replica_dir
            assert_same_state(second, restored.state)
            target = training_state(seed=3, width=512)
            into = ckpt.restore(step=2, into=target)
            assert into.location == "replica"
            assert_same_state(second, into.state)
            lines = listing(config, "rep")
            assert "both" in lines[1] and "replica" in lines[2] and "both" not in lines[2]
            assert ckpt.restore(step=1).location == "primary"
    finally:
        committer.close()


def test_corrupt_primary_file_restores_the_same_step_from_the_replica(
    dcs_config: DCSConfig, tmp_path: Path, inline: Inline
) -> None:
    config = replica_config(dcs_config, tmp_path)
    committer = inline(config)
    first, second = training_state(seed=1, width=512), training_state(seed=2, width=512)
    try:
        with Checkpointer("flip", config, celery_app=committer) as ckpt:
            save_and_replicate(ckpt, config, first, 1)
            save_and_replicate(ckpt, config, second, 2)
    finally:
        committer.close()
    victim = sorted((Path(config.checkpoint.dir) / "flip" / step_dir_name(2)).glob("*.safetensors"))[-1]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x40  # same size: only the checksum tells
    victim.write_bytes(bytes(data))
    verified = dcs_ckpt(config, "verify", "--run", "flip", "--replica-dir", str(config.checkpoint.replica_dir))
    assert verified.returncode == 1 and "step 2 (primary): BAD" in verified.stderr and victim.name in verified.stderr
    assert "step 2 (replica): ok" in verified.stdout
    with Checkpointer("flip", config) as ckpt, warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        restored = ckpt.restore()
        assert restored.step == 2 and restored.location == "replica"  # the same step, not the older one
        assert_same_state(second, restored.state)
        assert any(
            "primary copy of step 2 is corrupt" in str(w.message) and victim.name in str(w.message) for w in seen
        )
    # the verified restore healed the primary file from the replica's bytes
    verified = dcs_ckpt(config, "verify", "--run", "flip", "--replica-dir", str(config.checkpoint.replica_dir))
    assert verified.returncode == 0 and "step 2 (primary): ok" in verified.stdout, verified.stdout + verified.stderr


def test_unwritable_replica_fails_the_replica_task_never_the_commit(dcs_config: DCSConfig, tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_bytes(b"x")  # even root cannot create a directory under a regular file
    port = free_port()
    config = replica_config(
        dcs_config, tmp_path, replica_dir=blocker / "replica", enable_metrics=True, metrics_port=port
    )
    prom = {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "prom")}
    worker = WorkerProcess(config, tmp_path / "worker.log", env=prom).start()
    state = training_state(seed=4, width=256)
    app = make_celery(config)
    ledger = StepLedger(sync_client(config), Keys(config.redis.namespace))
    try:
        with Checkpointer("ro", config) as ckpt:
            info = ckpt.save(state, step=1).wait(timeout=120)  # the commit and the trainer's save succeed
            assert info.step == 1 and primary_steps(config, "ro") == [1]
            result = app.AsyncResult(replica_task_id(ledger.read("ro", 1).token))
            wait_until(lambda: result.state == "FAILURE", 120, "the replicate task to fail")
            assert "ReplicaFailed" in str(result.traceback) and "cannot be written" in str(result.traceback)
            wait_until(lambda: "replica of step 1 of run 'ro' failed" in worker.log_tail(20000), 30, "the log line")
            assert "ReplicaFailed" in worker.log_tail(20000)
            assert value(scrape(port), "dcs_errors_total", error_type="checkpoint_replica") == 1.0
            name = step_dir_name(1)  # outside the replica root: elsewhere, and the primary root itself
            for hostile in (tmp_path / "elsewhere" / "ro" / name, Path(config.checkpoint.dir) / "ro" / name):
                body = {"run": "ro", "step": 1, "step_dir": str(info.path), "replica_step_dir": str(hostile)}
                sent = app.send_task(TaskName.REPLICATE.value, args=[body], queue=node_queue(config.host_name))
                wait_until(lambda sent=sent: sent.state == "FAILURE", 60, "the hostile replicate task to fail")
                assert "UntrustedPath" in str(sent.traceback), sent.traceback
            ckpt.save(state, step=2).wait(timeout=120)  # later saves are unaffected
            restored = ckpt.restore()
            assert restored.step == 2 and restored.location == "primary"
            assert_same_state(state, restored.state)
    finally:
        app.close()
        worker.discard()


def test_retention_prunes_the_primary_and_the_replica(dcs_config: DCSConfig, tmp_path: Path, inline: Inline) -> None:
    config = replica_config(dcs_config, tmp_path, keep_last=2)
    committer = inline(config)
    state = training_state(seed=5, width=128)
    try:
        with Checkpointer("keep", config, celery_app=committer) as ckpt:
            for step in (1, 2, 3, 4):
                save_and_replicate(ckpt, config, state, step)
            wait_until(lambda: primary_steps(config, "keep") == [3, 4], 60, "primary retention")
            wait_until(lambda: replica_steps(config, "keep") == [3, 4], 60, "replica retention")
    finally:
        committer.close()
    gc = dcs_ckpt(
        config, "gc", "--run", "keep", "--keep-last", "1", "--replica-dir", str(config.checkpoint.replica_dir)
    )
    assert gc.returncode == 0 and "primary: deleted steps: [3]" in gc.stdout, gc.stdout
    assert "replica: deleted steps: [3]" in gc.stdout
    assert primary_steps(config, "keep") == [4] and replica_steps(config, "keep") == [4]


def test_multi_rank_step_replicated_per_rank_and_restored_whole_from_the_replica(
    dcs_config: DCSConfig, tmp_path: Path, inline: Inline
) -> None:
    config = replica_config(dcs_config, tmp_path)
    committer = inline(config)
    parts = [{"w": torch.arange(12, dtype=torch.float32).reshape(4, 3) + 100 * r, "r": r} for r in range(2)]
    try:
        for rank in range(2):
            with Checkpointer("ranks", config, rank=rank, world_size=2, celery_app=committer) as ckpt:
                ckpt.save(parts[rank], step=7, sharding={"w": 0}).wait(timeout=120)
        assert config.checkpoint.replica_dir is not None
        replica_root = Path(config.checkpoint.replica_dir) / "ranks"
        for rank in range(2):
            wait_until(lambda r=rank: bool(step_dirs(replica_root / f"rank-{r:05d}")), 120, f"rank {rank} replica")
    finally:
        committer.close()
    assert "both" in listing(config, "ranks")[7]
    shutil.rmtree(Path(config.checkpoint.dir) / "ranks" / "rank-00001" / step_dir_name(7))
    with Checkpointer("ranks", config) as whole:
        restored = whole.restore()
    assert restored.step == 7 and restored.location == "replica" and restored.path == replica_root
    assert torch.equal(restored.state["w"], torch.cat([parts[0]["w"], parts[1]["w"]]))
    assert "replica" in listing(config, "ranks")[7]


def test_a_restore_heals_a_damaged_shared_primary_file_from_the_replica(
    dcs_config: DCSConfig, tmp_path: Path, inline: Inline
) -> None:
    """Step 2 refers to step 1's file (incremental); that primary file is damaged. The restore reads the replica
    (with a warning), then rewrites the primary file from the verified replica bytes: the next restore reads
    the primary again, and so does step 1."""
    config = replica_config(dcs_config, tmp_path)
    committer = inline(config)
    state = training_state(seed=4)
    try:
        with Checkpointer("heal", config, celery_app=committer) as ckpt:
            for step in (1, 2):
                save_and_replicate(ckpt, config, state, step)
            shared = next((Path(config.checkpoint.dir) / "heal" / "step-000000001").glob("*.safetensors"))
            good = shared.read_bytes()
            data = bytearray(good)
            data[-1] ^= 0xFF
            shared.write_bytes(bytes(data))
            with pytest.warns(RuntimeWarning, match="trying the replica copy"):
                restored = ckpt.restore()
            assert restored.step == 2 and restored.location == "replica"
            assert shared.read_bytes() == good
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                assert ckpt.restore().location == "primary"
                assert ckpt.restore(step=1).location == "primary"
    finally:
        committer.close()
