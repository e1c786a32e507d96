"""Checkpoints kept in S3 (`DCS_CHECKPOINT_DIR=s3://bucket/prefix`), through a real S3 server (OpenStack Swift +
s3api): save, commit, list and restore bit-exact; failures named, nothing half visible. The worker's code runs in an
in-process committer (`inline`) where the behaviour is the store's; a real `dcs worker` where it is the worker's (a
kill mid-upload and its redelivery, a start refused for wrong credentials, ranks saving from their own processes)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dcs_tasks import Checkpointer
from dcs_tasks.checkpoint.format.layout import SUM_CHUNK_BYTES
from dcs_tasks.config import CheckpointCompression, DCSConfig
from dcs_tasks.errors import (
    ConfigError,
    CorruptCheckpoint,
    NoWorkerError,
    StorageAccessDenied,
)
from tests.checkpoint_support import Inline, assert_same_state, start_worker, training_state
from tests.helpers.preloaded import run_module
from tests.helpers.procs import child_env
from tests.storage.conftest import S3Bucket
from tests.storage.s3_support import MiB, objects, open_uploads, s3_config


def ckpt_cli(config: DCSConfig, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`dcs ckpt ARGS` as a user runs it, with DCS_CHECKPOINT_DIR=s3://... and the AWS environment."""
    done = run_module("dcs_tasks.cli.main", "ckpt", *args, workdir=tmp_path / "cli", env=child_env(config), timeout=120)
    assert "Traceback" not in done.stdout + done.stderr, done.stdout + done.stderr
    return done


@pytest.fixture
def worker_cleanup() -> Iterator[list]:
    workers: list = []
    yield workers
    for w in workers:
        w.discard()


def test_save_and_restore_through_s3_bit_exact(
    dcs_config: DCSConfig, tmp_path: Path, aws_env: S3Bucket, inline: Inline
) -> None:
    config = s3_config(dcs_config, tmp_path, aws_env, file_shard_bytes=8 * MiB)
    committer = inline(config)
    state = training_state(width=1500)  # ~18 MiB: three files, each a multipart upload of 5 MiB parts
    second = training_state(seed=3, width=1500)
    with Checkpointer("exp1", config, celery_app=committer) as ckpt:
        info = ckpt.save(state, step=10, metadata={"lr": 1e-3}).wait(timeout=120)
        assert str(info.path) == aws_env.url("fleet/ckpt/exp1/step-000000010")
        ckpt.save(second, step=20).wait(timeout=120)
        assert [i.step for i in ckpt.list()] == [10, 20]
        restored = ckpt.restore()
        assert restored.step == 20
        assert_same_state(second, restored.state)
        older = ckpt.restore(step=10)
        assert older.metadata == {"lr": 1e-3}
        assert_same_state(state, older.state)
        target = training_state(seed=9, width=1500)
        weight = target["model"]["0.weight"]
        filled = ckpt.restore(step=10, into=target)
        assert filled.state["model"]["0.weight"] is weight and torch.equal(weight, state["model"]["0.weight"])
    keys = objects(aws_env, "fleet/ckpt/exp1/")
    manifest = json.loads(
        aws_env.client()
        .get_object(Bucket=aws_env.bucket, Key="fleet/ckpt/exp1/step-000000010/manifest.json")["Body"]
        .read()
    )
    assert len(manifest["files"]) >= 3
    for f in manifest["files"]:
        assert keys[f"fleet/ckpt/exp1/step-000000010/{f['name']}"] == f["size"]
    latest = aws_env.client().get_object(Bucket=aws_env.bucket, Key="fleet/ckpt/exp1/latest")["Body"].read()
    assert latest.decode().strip() == "step-000000020"
    assert open_uploads(aws_env) == []
    assert not any(Path(".").glob("s3:*")), "an s3:// root must never become a local folder"


def test_dcs_ckpt_list_and_verify_read_s3_and_name_a_corrupt_object(
    dcs_config: DCSConfig, tmp_path: Path, aws_env: S3Bucket, inline: Inline
) -> None:
    config = s3_config(dcs_config, tmp_path, aws_env)
    committer = inline(config)
    with Checkpointer("cli", config, celery_app=committer) as ckpt:
        ckpt.save(training_state(seed=1), step=1).wait(timeout=120)
        ckpt.save(training_state(seed=2), step=2).wait(timeout=120)
    env_config = config
    listed = ckpt_cli(env_config, tmp_path, "list", "--run", "cli")
    assert listed.returncode == 0, listed.stderr
    steps = [line.split()[0] for line in listed.stdout.splitlines() if line.strip()]
    assert steps == ["1", "2"] and listed.stdout.splitlines()[-1].endswith("<- latest"), listed.stdout
    verified = ckpt_cli(env_config, tmp_path, "verify", "--run", "cli")
    assert verified.returncode == 0, verified.stdout + verified.stderr
    inspected = ckpt_cli(env_config, tmp_path, "inspect", "--run", "cli", "--step", "2")
    assert inspected.returncode == 0 and "step-000000002" in inspected.stdout, inspected.stdout + inspected.stderr
    # flip bytes of step 2's first file in the store: verify names it, restore falls back to step 1
    client = aws_env.client()
    manifest = json.loads(
        client.get_object(Bucket=aws_env.bucket, Key="fleet/ckpt/cli/step-000000002/manifest.json")["Body"].read()
    )
    key = f"fleet/ckpt/cli/step-000000002/{manifest['files'][0]['name']}"
    body = bytearray(client.get_object(Bucket=aws_env.bucket, Key=key)["Body"].read())
    body[-1] ^= 0xFF
    client.put_object(Bucket=aws_env.bucket, Key=key, Body=bytes(body))
    verified = ckpt_cli(env_config, tmp_path, "verify", "--run", "cli", "--step", "2")
    assert verified.returncode != 0 and "checksum" in verified.stdout + verified.stderr
    with Checkpointer("cli", config, celery_app=committer) as ckpt:
        with pytest.warns(RuntimeWarning, match="step 2 is corrupt"):
            restored = ckpt.restore()
        assert restored.step == 1
        assert_same_state(training_state(seed=1), restored.state)
        with pytest.raises(CorruptCheckpoint, match="checksum"):
            ckpt.restore(step=2)


def test_a_worker_killed_mid_upload_leaves_no_half_step_and_the_redelivery_commits(
    dcs_config: DCSConfig, tmp_path: Path, aws_env: S3Bucket, worker_cleanup: list
) -> None:
    """SIGKILL of the worker while its parts travel (uploads throttled to 4 MiB/s): no manifest, so no step is
    visible; the restarted worker (not throttled: the pace only makes the kill land mid-upload) gets the late-ack
    task again and the step commits bit-exact with no upload left open."""
    config = s3_config(
        dcs_config, tmp_path, aws_env, persist_throttle_bytes_per_second=4 * MiB, file_shard_bytes=32 * MiB
    )
    worker = start_worker(config, tmp_path, name="first")
    worker_cleanup.append(worker)
    state = training_state(width=1100)  # one 14.6 MiB file: three 5 MiB parts, about 3.6 s at 4 MiB/s
    with Checkpointer("killed", config) as ckpt:
        pending = ckpt.save(state, step=7)
        deadline = time.monotonic() + 30
        while not open_uploads(aws_env) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert open_uploads(aws_env), "no multipart upload started"
        time.sleep(1.0)
        for pid in worker.child_pids():
            os.kill(pid, signal.SIGKILL)
        worker.kill()
        assert "fleet/ckpt/killed/step-000000007/manifest.json" not in objects(aws_env)
        assert ckpt.list() == []
        unthrottled = config.model_copy(update={"persist_throttle_bytes_per_second": None})
        worker_cleanup.append(start_worker(unthrottled, tmp_path, name="second"))
        info = pending.wait(timeout=180)
        assert info.step == 7
        assert_same_state(state, ckpt.restore().state)
    assert open_uploads(aws_env) == []


def test_wrong_credentials_stop_the_worker_at_start_with_access_denied_and_nothing_is_written(
    dcs_config: DCSConfig, tmp_path: Path, aws_env: S3Bucket, monkeypatch: pytest.MonkeyPatch, worker_cleanup: list
) -> None:
    """The worker's start-up check (`dcs_tasks.checkpoint.preflight`) refuses credentials that may not write the
    root: no worker serves the host, so the trainer's save raises NoWorkerError at once."""
    config = s3_config(dcs_config, tmp_path, aws_env)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", aws_env.server.other_access_key)  # a user without rights on the bucket
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", aws_env.server.other_secret_key)
    with pytest.raises(RuntimeError, match="worker exited with 1") as refused:
        worker_cleanup.append(start_worker(config, tmp_path))
    assert "StorageAccessDenied" in str(refused.value) and aws_env.server.other_secret_key not in str(refused.value)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", aws_env.access_key)  # the trainer itself may read
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", aws_env.secret_key)
    with Checkpointer("denied", config) as ckpt:
        with pytest.raises(NoWorkerError):
            ckpt.save(training_state(), step=1)
        assert ckpt.list() == []
    assert objects(aws_env) == {}


def test_storage_urls_other_than_paths_and_s3_are_refused_by_name(
    dcs_config: DCSConfig, tmp_path: Path, aws_env: S3Bucket
) -> None:
    with pytest.raises((ConfigError, ValueError), match="scheme 'gs'"):
        DCSConfig(checkpoint_dir="gs://bucket/x")
    with pytest.raises((ConfigError, ValueError), match="bucket name"):
        DCSConfig(checkpoint_dir="s3://UPPER/x")
    with pytest.raises((ConfigError, ValueError), match=r"'\.\.' component"):
        DCSConfig(checkpoint_dir="s3://bucket/a/../b")


def test_access_denied_maps_to_a_named_error_for_readers(
    dcs_config: DCSConfig, tmp_path: Path, aws_env: S3Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = s3_config(dcs_config, tmp_path, aws_env)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", aws_env.server.other_access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", aws_env.server.other_secret_key)
    from dcs_tasks import storage

    root = storage.root(config.checkpoint.dir, config)
    with pytest.raises(StorageAccessDenied, match=r"403|AccessDenied"):  # a HEAD answer has no error body
        (root / "x").size()


@pytest.mark.distributed
def test_a_dtensor_state_saved_by_4_ranks_to_s3_restores_at_2_and_8_ranks_reading_only_needed_ranges(
    dcs_config: DCSConfig, tmp_path: Path, aws_env: S3Bucket, worker_cleanup: list
) -> None:
    """Real gloo groups (tests/distributed/test_checkpoint_dtensor.py's harness): FSDP/TP DTensors saved by 4
    ranks into S3, restored into DTensors of 2 ranks and of 8 ranks; at 8 ranks a rank restoring half a saved
    shard fetches only the checksum chunks it needs (ranged GETs), not the whole shard."""
    from tests.distributed.test_checkpoint_dtensor import check_restored, run_group

    config = s3_config(dcs_config, tmp_path, aws_env)
    worker_cleanup.append(start_worker(config, tmp_path))
    run_group(config, tmp_path, "save", 4, action="save", run="fsdp", mesh=[4], layout="fsdp", steps=[10])
    manifests = [k for k in objects(aws_env, "fleet/ckpt/fsdp/") if k.endswith("/manifest.json")]
    assert sorted(manifests) == [f"fleet/ckpt/fsdp/rank-{r:05d}/step-000000010/manifest.json" for r in range(4)]
    check_restored(
        run_group(config, tmp_path, "w2", 2, action="restore", run="fsdp", mesh=[2], layout="fsdp", step=10), 10, 4
    )
    eight = run_group(
        config, tmp_path, "w8", 8, action="restore", run="fsdp", mesh=[8], layout="fsdp", step=10, partial=True
    )
    check_restored(eight, 10, 4)
    whole_part = 4097 * 256 * 4  # one saving rank's shard of w
    for rank, rep in eight.items():
        assert rep["partial_same"], rank
        assert rep["partial_read"] <= rep["partial_local_bytes"] + 4 * SUM_CHUNK_BYTES < whole_part, (rank, rep)


def test_incremental_saves_on_s3_refer_to_earlier_objects_and_rewrite_every_k_steps(
    dcs_config: DCSConfig, tmp_path: Path, aws_env: S3Bucket, inline: Inline
) -> None:
    """Unchanged files are recorded as references, not uploaded; with `incremental_full_every=3` no stored file
    serves more than 3 steps (failure isolation); every step restores bit-exact through its references."""
    config = s3_config(dcs_config, tmp_path, aws_env, incremental_full_every=3)
    committer = inline(config)
    state = training_state(width=600)
    with Checkpointer("inc", config, celery_app=committer) as ckpt:
        for step in range(1, 6):
            ckpt.save(state, step=step).wait(timeout=120)
        sources = {}
        for step in range(1, 6):
            manifest = ckpt.restore(step=step)
            assert_same_state(state, manifest.state)
            key = f"fleet/ckpt/inc/step-{step:09d}/manifest.json"
            files = json.loads(aws_env.client().get_object(Bucket=aws_env.bucket, Key=key)["Body"].read())["files"]
            sources[step] = {f.get("source_step") for f in files}
    assert sources == {1: {None}, 2: {1}, 3: {1}, 4: {None}, 5: {4}}, sources
    stored = objects(aws_env, "fleet/ckpt/inc/")
    assert not any(k.startswith("fleet/ckpt/inc/step-000000002/") and k.endswith(".safetensors") for k in stored)


def test_retention_on_s3_keeps_the_newest_steps_and_the_objects_they_refer_to(
    dcs_config: DCSConfig, tmp_path: Path, aws_env: S3Bucket, inline: Inline
) -> None:
    """keep_last=2 after each commit (the worker's retention, run by an in-process committer) and
    `dcs ckpt gc --keep-last 1`: deleted steps vanish manifest first; a deleted step whose objects later steps
    refer to is retired (marker, objects kept) until nothing refers to it; every kept step restores bit-exact."""
    config = s3_config(dcs_config, tmp_path, aws_env, keep_last=2)
    committer = inline(config)
    state = training_state(width=300)
    run = "fleet/ckpt/kept/"
    with Checkpointer("kept", config, celery_app=committer) as ckpt:
        for step in range(1, 5):
            ckpt.save(state, step=step).wait(timeout=120)
        deadline = time.monotonic() + 30
        while [i.step for i in ckpt.list()] != [3, 4] and time.monotonic() < deadline:
            time.sleep(0.2)  # retention runs as its own task after each commit
        assert [i.step for i in ckpt.list()] == [3, 4]
        stored = objects(aws_env, run)
        assert f"{run}step-000000001/.retired" in stored  # steps 3 and 4 refer to step 1's objects
        assert any(k.startswith(f"{run}step-000000001/") and k.endswith(".safetensors") for k in stored)
        assert not any(k.startswith(f"{run}step-000000002/") for k in stored)
        for step in (3, 4):
            assert_same_state(state, ckpt.restore(step=step).state)
    gc = ckpt_cli(config, tmp_path, "gc", "--run", "kept", "--keep-last", "1")
    assert gc.returncode == 0 and "deleted steps: [3]" in gc.stdout, gc.stdout + gc.stderr
    with Checkpointer("kept", config, celery_app=committer) as ckpt:
        assert [i.step for i in ckpt.list()] == [4]
        assert_same_state(state, ckpt.restore().state)


@pytest.mark.parametrize("primary_on_s3", [False, True], ids=["file-to-s3", "s3-to-file"])
def test_a_replica_of_the_other_kind_is_written_verified_and_restored_from_when_the_primary_is_damaged(
    dcs_config: DCSConfig, tmp_path: Path, aws_env: S3Bucket, inline: Inline, primary_on_s3: bool
) -> None:
    """checkpoint_dir on files and replica_dir on S3, and the reverse: each commit is copied to the other store
    (incremental references included), verified there, then published manifest last; with the primary copy of
    the newest step damaged, restore reads the replica and says so."""
    from dcs_tasks import storage
    from dcs_tasks.checkpoint.restore.reader import step_dirs

    s3_root = DCSConfig.model_validate({"checkpoint_dir": aws_env.url("fleet/replica")}).checkpoint.dir
    roots = {"checkpoint_dir": s3_root, "replica_dir": tmp_path / "replica"}
    if not primary_on_s3:
        roots = {"checkpoint_dir": tmp_path / "primary", "replica_dir": s3_root}
    config = s3_config(dcs_config, tmp_path, aws_env, **roots)
    committer = inline(config)
    state = training_state(width=400)
    assert config.checkpoint.replica_dir is not None
    replica_run = storage.root(config.checkpoint.replica_dir, config) / "mixed"
    with Checkpointer("mixed", config, celery_app=committer) as ckpt:
        for step in (1, 2):
            ckpt.save(state, step=step).wait(timeout=120)
        deadline = time.monotonic() + 60
        while [s for s, _ in step_dirs(replica_run)] != [1, 2] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [s for s, _ in step_dirs(replica_run)] == [1, 2]
        primary_step = storage.root(config.checkpoint.dir, config) / "mixed" / "step-000000001"
        manifest = ckpt.restore(step=1)
        assert manifest.location == "primary"
        # damage the primary's stored file (step 2 refers to it): step 2 comes from the replica
        name = json.loads(
            (primary_step / "manifest.json").read_text()
            if isinstance(primary_step, Path)
            else aws_env.client()
            .get_object(Bucket=aws_env.bucket, Key=f"{primary_step.key}/manifest.json")["Body"]
            .read()
        )["files"][0]["name"]
        if isinstance(primary_step, Path):
            stored = primary_step / name
            data = bytearray(stored.read_bytes())
            data[-1] ^= 0xFF
            stored.write_bytes(bytes(data))
        else:
            key = f"{primary_step.key}/{name}"
            data = bytearray(aws_env.client().get_object(Bucket=aws_env.bucket, Key=key)["Body"].read())
            data[-1] ^= 0xFF
            aws_env.client().put_object(Bucket=aws_env.bucket, Key=key, Body=bytes(data))
        with pytest.warns(RuntimeWarning, match="trying the replica copy"):
            restored = ckpt.restore()
        assert restored.step == 2 and restored.location == "replica"
        assert_same_state(state, restored.state)


def test_dcs_ckpt_export_reads_a_step_from_s3_into_a_hugging_face_directory(
    dcs_config: DCSConfig, tmp_path: Path, aws_env: S3Bucket, inline: Inline
) -> None:
    from safetensors.torch import load_file

    config = s3_config(dcs_config, tmp_path, aws_env)
    committer = inline(config)
    state = training_state(seed=5)
    with Checkpointer("export", config, celery_app=committer) as ckpt:
        ckpt.save(state, step=3).wait(timeout=120)
    out = tmp_path / "hf"
    done = ckpt_cli(
        config, tmp_path, "export", "--run", "export", "--format", "hf", "--out", str(out), "--prefix", "model/"
    )
    assert done.returncode == 0, done.stdout + done.stderr
    exported = load_file(str(out / "model.safetensors"))
    assert set(exported) == {name.replace("/", ".") for name in state["model"]}
    for name, tensor in state["model"].items():
        assert torch.equal(exported[name.replace("/", ".")], tensor), name


def test_dcs_ckpt_import_commits_a_hugging_face_directory_into_s3_through_the_same_committer(
    dcs_config: DCSConfig, tmp_path: Path, aws_env: S3Bucket
) -> None:
    """`dcs ckpt import --format hf` with an s3:// root (given as --dir): the step is uploaded and published
    exactly as a worker's commit does (manifest last, latest moved), and restores bit-exact."""
    from safetensors.torch import save_file

    source = tmp_path / "hf-in"
    source.mkdir()
    weights = {"embed.weight": torch.randn(64, 32), "head.bias": torch.randn(32)}
    save_file(weights, str(source / "model.safetensors"))
    config = s3_config(dcs_config, tmp_path, aws_env)
    done = ckpt_cli(
        config, tmp_path, "import", "--run", "imported", "--step", "7", "--from", str(source), "--format", "hf",
        "--dir", aws_env.url("fleet/other"),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    stored = objects(aws_env, "fleet/other/imported/")
    assert "fleet/other/imported/step-000000007/manifest.json" in stored
    assert aws_env.client().get_object(Bucket=aws_env.bucket, Key="fleet/other/imported/latest")["Body"].read() == (
        b"step-000000007\n"
    )
    other = config.model_copy(
        update={"checkpoint_dir": DCSConfig(checkpoint_dir=aws_env.url("fleet/other")).checkpoint.dir}
    )
    with Checkpointer("imported", other) as ckpt:
        restored = ckpt.restore()
    assert restored.step == 7
    saved = restored.state["model"]
    assert set(saved) == set(weights)
    for name, tensor in weights.items():
        assert torch.equal(saved[name], tensor), name


def test_zstd_compressed_steps_in_s3_restore_bit_exact_and_verify(
    dcs_config: DCSConfig, tmp_path: Path, aws_env: S3Bucket, inline: Inline
) -> None:
    """checkpoint_compression=zstd on S3: compressible files are stored as `<name>.zst` objects smaller than the
    bytes, restore (new memory and into=) and `dcs ckpt verify` decompress and check them; a flipped byte in a
    compressed object is CorruptCheckpoint."""
    config = s3_config(
        dcs_config, tmp_path, aws_env, checkpoint_compression=CheckpointCompression.ZSTD, incremental_saves=False
    )
    committer = inline(config)
    state = {"ids": torch.arange(1 << 18, dtype=torch.int64) % 7, "w": torch.randn(256, 256)}
    with Checkpointer("zst", config, celery_app=committer) as ckpt:
        info = ckpt.save(state, step=1).wait(timeout=120)
        restored = ckpt.restore()
        assert_same_state(state, restored.state)
        target = {"ids": torch.zeros(1 << 18, dtype=torch.int64), "w": torch.zeros(256, 256)}
        ckpt.restore(into=target)
        assert_same_state(state, target)
    key = "fleet/ckpt/zst/step-000000001/manifest.json"
    manifest = json.loads(aws_env.client().get_object(Bucket=aws_env.bucket, Key=key)["Body"].read())
    packed = [f for f in manifest["files"] if f.get("compression") == "zstd"]
    assert packed and all(f["stored_size"] < f["size"] for f in packed)
    stored = objects(aws_env, "fleet/ckpt/zst/step-000000001/")
    for f in packed:
        assert stored[f"fleet/ckpt/zst/step-000000001/{f['name']}.zst"] == f["stored_size"]
    assert ckpt_cli(config, tmp_path, "verify", "--run", "zst").returncode == 0
    victim = f"fleet/ckpt/zst/step-000000001/{packed[0]['name']}.zst"
    body = bytearray(aws_env.client().get_object(Bucket=aws_env.bucket, Key=victim)["Body"].read())
    body[len(body) // 2] ^= 0xFF
    aws_env.client().put_object(Bucket=aws_env.bucket, Key=victim, Body=bytes(body))
    with Checkpointer("zst", config, celery_app=committer) as ckpt, pytest.raises(CorruptCheckpoint):
        ckpt.restore(step=1)
    assert info.step == 1
