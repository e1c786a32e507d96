"""Incremental saves (persisted by an in-process committer, the worker's code; the kill -9 cases by a real
`dcs worker`): a fine-tuning state's frozen files are written once and referred to by later steps (always the step
holding the bytes), and restore, `dcs ckpt verify/list`, HF export and multi-rank restores read them transparently;
a corrupt or missing shared file makes every step using it fall back; retention keeps what kept steps refer to,
across a kill -9 of the worker between steps and one while its retention task waits for the reference lock."""

from __future__ import annotations

import contextlib
import copy
import fcntl
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from dcs_tasks import Checkpointer
from dcs_tasks.checkpoint.format.layout import read_manifest
from dcs_tasks.checkpoint.inline import InlineCommitter
from dcs_tasks.checkpoint.store.ledger.incremental import REFS_LOCK_NAME, RETIRED_NAME
from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import CorruptCheckpoint
from tests.checkpoint_support import Inline, assert_same_state, ckpt_config, dcs_ckpt, start_worker, wait_until

pytestmark = pytest.mark.integration

MiB = 1 << 20


def finetune_state(layers: int = 6) -> dict[str, Any]:
    """A LoRA-style state: per layer a frozen 384 KiB weight next to a small trainable adapter (interleaved, as
    `state_dict()` orders them), the adapters' optimizer moments, and a step counter."""
    torch.manual_seed(0)
    model: dict[str, torch.Tensor] = {}
    for i in range(layers):
        model[f"layers.{i}.weight"] = torch.randn(384, 256)
        model[f"layers.{i}.lora_a"] = torch.randn(4, 256)
    optim = {name: torch.zeros_like(t) for name, t in model.items() if "lora" in name}
    return {"model": model, "optim": optim, "step": 0}


def train(state: dict[str, Any]) -> None:
    for name, moment in state["optim"].items():
        moment.add_(0.1)
        state["model"][name].add_(moment)
    state["step"] += 1


@pytest.fixture
def served(dcs_config: DCSConfig, tmp_path: Path) -> DCSConfig:
    """A config with 1 MiB files."""
    return ckpt_config(dcs_config, tmp_path, file_shard_bytes=MiB)


@pytest.fixture
def committer(served: DCSConfig, inline: Inline) -> InlineCommitter:
    """The worker's persist and commit for `served`, in this process."""
    return inline(served)


def save_steps(ckpt: Checkpointer, state: dict[str, Any], steps: range) -> dict[int, Any]:
    """Train, save and wait for each of `steps`; returns a copy of the state each step saved."""
    saved = {}
    for step in steps:
        train(state)
        ckpt.save(state, step=step).wait(timeout=90)
        saved[step] = copy.deepcopy(state)
    return saved


def manifest_of(run_dir: Path, step: int) -> Any:
    return read_manifest(run_dir / f"step-{step:09d}" / "manifest.json")


def test_frozen_files_are_written_once_and_every_reader_follows_the_reference(
    served: DCSConfig, committer: InlineCommitter, tmp_path: Path
) -> None:
    config, state = served, finetune_state()
    with Checkpointer("ft", config, celery_app=committer) as ckpt:
        saved = save_steps(ckpt, state, range(1, 5))
        for step in range(1, 5):
            assert_same_state(saved[step], ckpt.restore(step=step).state)
        assert_same_state(saved[4], ckpt.restore(into=finetune_state()).state)
    with Checkpointer("full", config.model_copy(update={"incremental_saves": False}), celery_app=committer) as ckpt:
        save_steps(ckpt, state, range(1, 4))
    run_dir = config.checkpoint.dir / "ft"
    # save 1: no earlier step; save 2: the adapters were seen changing, so the layout moved them apart
    assert all(f.source_step is None for s in (1, 2) for f in manifest_of(run_dir, s).files)
    for step in (3, 4):
        manifest = manifest_of(run_dir, step)
        frozen = {
            f.name
            for f in manifest.files
            if any(t.file == f.name for n, t in manifest.tensors.items() if n.endswith("weight"))
        }
        refs = {f.name: f.source_step for f in manifest.files}
        assert {refs[name] for name in frozen} == {2}  # the holder, never step 3 (no chains)
        assert all(refs[f] is None for f in refs if f not in frozen)
        on_disk = sum(p.stat().st_size for p in (run_dir / f"step-{step:09d}").glob("*.safetensors"))
        assert on_disk < 0.15 * manifest.total_bytes, (on_disk, manifest.total_bytes)
    assert all(f.source_step is None for s in (1, 2, 3) for f in manifest_of(config.checkpoint.dir / "full", s).files)
    done = dcs_ckpt(config, "verify", "--run", "ft")
    assert done.returncode == 0 and "step 4: ok" in done.stdout, done.stderr
    listed = dcs_ckpt(config, "list", "--run", "ft").stdout
    assert "from earlier steps" in listed.splitlines()[-1], listed
    out = tmp_path / "hf"
    assert dcs_ckpt(config, "export", "--run", "ft", "--step", "4", "--out", str(out)).returncode == 0
    exported = load_file(str(out / "model.safetensors"))
    assert_same_state(dict(sorted(saved[4]["model"].items())), dict(sorted(exported.items())))


def test_two_ranks_save_incrementally_and_restore_at_one(served: DCSConfig, committer: InlineCommitter) -> None:
    config = served
    states = [finetune_state(layers=3), finetune_state(layers=3)]
    states[1]["model"]["layers.0.weight"].neg_()  # rank-local tensors differ between the ranks
    ranks = [Checkpointer("mr", config, rank=r, world_size=2, celery_app=committer) for r in range(2)]
    for step in (1, 2, 3):
        pendings = []
        for rank, ckpt in enumerate(ranks):
            train(states[rank])
            pendings.append(ckpt.save(states[rank], step=step))
        for pending in pendings:
            pending.wait(timeout=90)
    for ckpt in ranks:
        ckpt.close()
    with Checkpointer("mr", config) as single:
        assert_same_state(states[0], single.restore().state)
    for rank in range(2):
        manifest = manifest_of(config.checkpoint.dir / "mr" / f"rank-{rank:05d}", 3)
        assert {f.source_step for f in manifest.files} == {None, 2}


def _flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_a_corrupt_or_missing_shared_file_fails_every_step_using_it(
    served: DCSConfig, committer: InlineCommitter
) -> None:
    config = served
    with Checkpointer("bad", config, celery_app=committer) as ckpt:
        saved = save_steps(ckpt, finetune_state(), range(1, 5))
        run_dir = config.checkpoint.dir / "bad"
        shared = next(f for f in manifest_of(run_dir, 4).files if f.source_step == 2)
        held = run_dir / "step-000000002" / shared.name
        _flip_byte(held, shared.size - 1)
        with pytest.warns(RuntimeWarning, match=f"step-000000002/{shared.name}") as caught:
            restored = ckpt.restore()
        fallbacks = [str(w.message)[:20] for w in caught if issubclass(w.category, RuntimeWarning)]
        assert restored.step == 1 and fallbacks == [f"checkpoint step {s} is"[:20] for s in (4, 3, 2)]
        assert_same_state(saved[1], restored.state)
        held.unlink()
        with pytest.raises(CorruptCheckpoint, match=f"step-000000002/{shared.name} is missing"):
            ckpt.restore(step=4)
    done = dcs_ckpt(config, "verify", "--run", "bad")
    assert done.returncode == 1 and "step 1: ok" in done.stdout
    assert [f"step {s}: BAD" in done.stderr for s in (2, 3, 4)] == [True] * 3, done.stderr


def test_retention_keeps_what_kept_steps_use_across_kill_9(dcs_config: DCSConfig, tmp_path: Path) -> None:
    config = ckpt_config(dcs_config, tmp_path, file_shard_bytes=MiB, keep_last=1)
    worker = start_worker(config, tmp_path, concurrency=1)
    run_dir = config.checkpoint.dir / "keep"
    state = finetune_state()
    try:
        with Checkpointer("keep", config) as ckpt:
            for step in (1, 2, 3):
                train(state)
                ckpt.save(state, step=step).wait(timeout=90)
            retired = run_dir / "step-000000002" / RETIRED_NAME
            wait_until(lambda: retired.exists() and not retired.with_name("manifest.json").exists(), 60, "retention")
            worker.kill()  # kill -9 between steps
            worker = start_worker(config, tmp_path, name="worker2")  # 2 children: one may wait on the lock
            # step 4's retention waits for the reference lock (held here); its worker child is killed there
            with open(run_dir / REFS_LOCK_NAME, "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_SH)
                train(state)
                ckpt.save(state, step=4).wait(timeout=90)
                received = re.compile(r"dcs\.ckpt\.retention\[\S+\] received")
                wait_until(lambda: received.search(worker.log_tail(10**6)) is not None, 60, "step 4's retention")
                time.sleep(0.5)  # it is blocked on the lock this test holds
                assert (run_dir / "step-000000003" / "manifest.json").exists()
                for pid in worker.child_pids():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            train(state)
            ckpt.save(state, step=5).wait(timeout=90)
            wait_until(lambda: [i.step for i in ckpt.list()] == [5], 90, "retention down to step 5")
            assert_same_state(state, ckpt.restore().state)
    finally:
        worker.kill()
    manifest = manifest_of(run_dir, 5)
    needed = {f.name for f in manifest.files if f.source_step == 2}
    assert needed and {f.source_step for f in manifest.files} == {None, 2}
    husk = run_dir / "step-000000002"
    assert sorted(p.name for p in husk.iterdir()) == sorted([RETIRED_NAME, *needed])  # retired: only what 5 uses
    assert sorted(p.name for p in run_dir.glob("step-*")) == ["step-000000002", "step-000000005"]
    done = dcs_ckpt(config, "verify", "--run", "keep")
    assert done.returncode == 0 and "step 5: ok" in done.stdout, done.stderr


def test_one_stored_file_serves_at_most_incremental_full_every_steps(
    dcs_config: DCSConfig, tmp_path: Path, inline: Inline
) -> None:
    """Failure isolation: with `incremental_full_every=3`, an unchanged file is written anew at the fourth step,
    so damage to one stored file takes at most 3 steps with it, and an older step still restores."""
    config = ckpt_config(dcs_config, tmp_path, incremental_full_every=3)
    committer = inline(config)
    state = {"model": {"w": torch.arange(65536, dtype=torch.float32)}}
    try:
        with Checkpointer("isolated", config, celery_app=committer) as ckpt:
            infos = [ckpt.save(state, step=s).wait(timeout=60) for s in range(1, 6)]
            sources = [{f.source_step for f in read_manifest(Path(i.path) / "manifest.json").files} for i in infos]
            assert sources == [{None}, {1}, {1}, {None}, {4}]
            # damage step 4's stored file: steps 4 and 5 go, step 3 (through step 1's file) still restores
            stored = next(Path(infos[3].path).glob("*.safetensors"))
            data = bytearray(stored.read_bytes())
            data[-1] ^= 0xFF
            stored.write_bytes(bytes(data))
            with pytest.warns(RuntimeWarning, match="corrupt"):
                restored = ckpt.restore()
            assert restored.step == 3
            assert_same_state(state, restored.state)
    finally:
        committer.close()
