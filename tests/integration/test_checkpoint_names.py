"""One run-name rule and one step rule for every entry point: `Checkpointer`, the task payload models and
`dcs ckpt --run`. Bad names (`.`, `..`, `/etc`, a trailing newline, hidden names) and bad steps (negative,
bool, float, str) are a CheckpointError naming them, before Redis, the staging pool or the disk are touched."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis
from pydantic import ValidationError

from dcs_tasks import Checkpointer
from dcs_tasks.checkpoint.store.payloads import (
    PersistRequest,
    RetentionRequest,
    StepRef,
    validate_run_name,
    validate_step,
)
from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import CheckpointError
from dcs_tasks.keys import Keys
from tests.checkpoint_support import Inline, assert_same_state, ckpt_config, training_state
from tests.helpers.preloaded import run_module
from tests.helpers.procs import child_env

pytestmark = pytest.mark.integration

BAD_RUNS = [".", "..", "ok\n", "/etc", "a/b", "../x", ".hidden", "-rf", "", "x" * 129, "sp ace", "nul\0", "é"]
GOOD_RUNS = ["exp1", "my_run.v2-final", "_x", "9", "exp.rank-00001", "x" * 128]
BAD_STEPS: list[Any] = [-1, True, False, 1.5, "3", None]


@pytest.mark.parametrize("run", BAD_RUNS)
def test_bad_run_names_are_refused_by_every_model(run: str) -> None:
    with pytest.raises(CheckpointError, match="run name"):
        validate_run_name(run)
    with pytest.raises(ValidationError, match="run name"):
        StepRef(run=run, step=1, token="t" * 32, step_dir="/ckpt/x/step-000000001")
    with pytest.raises(ValidationError, match="run name"):
        RetentionRequest(run=run, run_dir="/ckpt/x", policy={"keep_last": 1})


@pytest.mark.parametrize("run", GOOD_RUNS)
def test_good_run_names_pass(run: str) -> None:
    assert validate_run_name(run) == run
    assert StepRef(run=run, step=0, token="t" * 32, step_dir="/ckpt/r/step-000000000").run == run


@pytest.mark.parametrize("step", BAD_STEPS)
def test_bad_steps_are_refused(step: Any) -> None:
    with pytest.raises(CheckpointError, match="step must be an integer >= 0"):
        validate_step(step)
    with pytest.raises(ValidationError):
        StepRef(run="r", step=step, token="t" * 32, step_dir="/ckpt/r/step-000000001")


@pytest.mark.parametrize(
    "field, value",
    [
        ("step_dir", "ckpt/r/step-000000001"),  # relative
        ("step_dir", "/ckpt/r/../r/step-000000001"),
        ("step_dir", "/ckpt/r/./step-000000001"),
        ("step_dir", "/ckpt/r/step-000000002"),  # another step's directory
        ("step_dir", "/ckpt/r/step-000000001/"),
        ("staging_path", "/dev/shm/../etc/passwd"),
        ("staging_path", "stage"),
        ("file_name", "../../etc/cron.d/x.safetensors"),
        ("file_name", "manifest.json"),
    ],
)
def test_payload_paths_must_be_clean(field: str, value: str) -> None:
    ref: dict[str, Any] = {"run": "r", "step": 1, "token": "t" * 32, "step_dir": "/ckpt/r/step-000000001"}
    payload: dict[str, Any] = {"ref": ref, "file_name": "model-00001-of-00001.safetensors"}
    payload.update(staging_path="/dev/shm/dcs-dcs-r-1-0123abcd-0.stage", offset=0, length=1)
    PersistRequest.model_validate(payload)
    if field == "step_dir":
        ref[field] = value
    else:
        payload[field] = value
    with pytest.raises(ValidationError):
        PersistRequest.model_validate(payload)


@pytest.mark.parametrize("action, run", [("gc", ".."), ("list", "/etc"), ("verify", "."), ("inspect", "ok\n")])
def test_dcs_ckpt_refuses_bad_run_names(action: str, run: str, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    env = child_env(DCSConfig(checkpoint_dir=root, keep_last=1))
    argv = ("ckpt", action, "--run", run, "--dir", str(root))
    proc = run_module("dcs_tasks.cli.main", *argv, workdir=tmp_path / "out", env=env, timeout=60)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "--run" in proc.stderr and "run name" in proc.stderr, proc.stderr


def test_checkpointer_refuses_bad_runs_and_steps_before_touching_anything(
    dcs_config: DCSConfig, tmp_path: Path, inline: Inline
) -> None:
    config = ckpt_config(dcs_config, tmp_path)
    staging = Path(config.host.staging_dir)
    for run in BAD_RUNS:
        with pytest.raises(CheckpointError, match="run name"):
            Checkpointer(run, config)
    assert not staging.exists() or not list(staging.iterdir())  # no staging pool was made
    for kwargs in ({"rank": True, "world_size": 2}, {"rank": 0, "world_size": 1.0}, {"rank": -1, "world_size": 2}):
        with pytest.raises(CheckpointError):
            Checkpointer("exp", config, **kwargs)
    committer = inline(config)
    client = redis.Redis.from_url(config.redis.url)
    try:
        with Checkpointer("exp", config, celery_app=committer) as ckpt:
            state = training_state()
            for step in BAD_STEPS:
                with pytest.raises(CheckpointError, match=rf"step must be an integer >= 0, not .*{step!r}"):
                    ckpt.save(state, step=step)
            keys = Keys(config.redis.namespace)
            assert not client.exists(keys.ckpt_inflight("exp"), *(keys.ckpt_state("exp", s) for s in (-1, 0, 1)))
            assert not (Path(config.checkpoint.dir) / "exp").exists()
            ckpt.save(state, step=0).wait(60)
            assert_same_state(state, ckpt.restore().state)
    finally:
        client.close()
