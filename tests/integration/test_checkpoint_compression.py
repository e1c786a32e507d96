"""Compressed checkpoints, persisted by an in-process committer (the worker's persist and commit, real redis-server):
with `checkpoint_compression=zstd` the worker's code stores compressible files as `<name>.zst` and the rest as they are;
restore (whole, `into=`, `strict=False`), `dcs ckpt verify|inspect` and the Hugging Face export give back the
saved bits; a damaged compressed file makes restore fall back to the previous step; hostile compression
fields in a manifest are refused with a CorruptCheckpoint naming the reason.

Steps 1 and 2 are written once per module; each test works on a private copy.
"""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from dcs_tasks import Checkpointer
from dcs_tasks.checkpoint.inline import InlineCommitter
from dcs_tasks.checkpoint.restore.reader import load_manifest
from dcs_tasks.checkpoint.store.ledger.retention import newest_intact
from dcs_tasks.config import CheckpointCompression, DCSConfig
from dcs_tasks.errors import CorruptCheckpoint
from tests.checkpoint_support import assert_same_state, ckpt_config, dcs_ckpt, training_state
from tests.helpers.redis_server import RedisServer
from tests.helpers.shm import shm_dir

pytestmark = pytest.mark.integration

RUN = "zrun"


def state_of(step: int) -> dict[str, Any]:
    """A training state plus a compressible file's worth of token ids and an incompressible file of noise."""
    state = training_state(seed=step)
    gen = torch.Generator().manual_seed(step)
    state["data"] = {
        "ids": torch.randint(0, 32000, (256 * 1024,), dtype=torch.int64, generator=gen),  # 2 MiB, own file
        "noise": torch.randint(0, 256, (1536 * 1024,), dtype=torch.uint8, generator=gen),  # 1.5 MiB, own file
        "zeros": torch.zeros(1000, 300, dtype=torch.float32),
    }
    state["step"] = step
    return state


@pytest.fixture(scope="module")
def golden(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("zgolden")
    server = RedisServer(root / "redis")
    server.start()
    base = DCSConfig(redis_url=server.url, checkpoint_dir=root / "ckpt", node_name="testhost", enable_metrics=False)
    config = ckpt_config(base, root, checkpoint_compression=CheckpointCompression.ZSTD, file_shard_bytes=1 << 20)
    committer = InlineCommitter(config)  # the worker's persist and commit, in this process
    try:
        with Checkpointer(RUN, config, celery_app=committer) as ckpt:
            for step in (1, 2):
                ckpt.save(state_of(step), step=step).wait(timeout=120)
    finally:
        committer.close()
        server.stop()
        shutil.rmtree(shm_dir(root), ignore_errors=True)
    yield root / "ckpt"


@pytest.fixture
def config(golden: Path, tmp_path: Path) -> DCSConfig:
    shutil.copytree(golden, tmp_path / "ckpt")
    return ckpt_config(
        DCSConfig(checkpoint_dir=tmp_path / "ckpt", node_name="testhost", enable_metrics=False), tmp_path
    )


def step_dir(config: DCSConfig, step: int) -> Path:
    return Path(config.checkpoint.dir) / RUN / f"step-{step:09d}"


def test_compressed_steps_restore_bit_exact_everywhere(config: DCSConfig, tmp_path: Path) -> None:
    manifest = load_manifest(step_dir(config, 2))
    packed = [f for f in manifest.files if f.compression]
    plain = [f for f in manifest.files if not f.compression]
    ids_file = manifest.tensors["data/ids"].file
    noise_file = manifest.tensors["data/noise"].file
    assert ids_file in {f.name for f in packed} and noise_file in {f.name for f in plain}
    for f in packed:
        assert f.compression == "zstd" and f.stored_size is not None and f.stored_size < f.size
        stored = f.stored_path(step_dir(config, 2))  # in step 1 when step 2 reuses the file (incremental)
        assert stored.name == f.name + ".zst" and stored.stat().st_size == f.stored_size
        assert not (stored.parent / f.name).exists()
    assert manifest.stored_bytes < manifest.total_bytes - 1_000_000  # ids: 2 MiB of values < 32000
    assert newest_intact(step_dir(config, 2).parent) == 2  # retention finds the .zst files intact
    with Checkpointer(RUN, config) as ckpt:
        assert_same_state(state_of(2), ckpt.restore().state)
        assert_same_state(state_of(1), ckpt.restore(step=1).state)
        target = state_of(7)
        restored = ckpt.restore(into=target)
        assert_same_state(state_of(2), restored.state)
        assert restored.state["data"]["ids"] is target["data"]["ids"]  # filled in place
        part = {"data": {"ids": torch.zeros(256 * 1024, dtype=torch.int64)}}
        ckpt.restore(into=part, strict=False)
        assert torch.equal(part["data"]["ids"], state_of(2)["data"]["ids"])
    done = dcs_ckpt(config, "verify", "--run", RUN)
    assert done.returncode == 0 and "step 1: ok" in done.stdout and "step 2: ok" in done.stdout, done.stderr
    described = json.loads(dcs_ckpt(config, "inspect", "--run", RUN).stdout)
    assert described["stored_bytes"] == manifest.stored_bytes < described["bytes"]
    assert {f["name"] for f in described["files"] if f.get("compression") == "zstd"} == {f.name for f in packed}
    out = tmp_path / "hf"
    done = dcs_ckpt(config, "export", "--run", RUN, "--format", "hf", "--prefix", "data/", "--out", str(out))
    assert done.returncode == 0, done.stderr
    exported = load_file(out / "model.safetensors")
    for name, tensor in state_of(2)["data"].items():
        assert torch.equal(exported[name], tensor), name


def restore_falls_back(config: DCSConfig) -> str:
    """restore() warns about step 2 and returns step 1, bit-exact; returns the warning text."""
    with Checkpointer(RUN, config) as ckpt, warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        restored = ckpt.restore()
    text = " | ".join(str(w.message) for w in seen if issubclass(w.category, RuntimeWarning))
    assert restored.step == 1 and "checkpoint step 2 is corrupt" in text, text
    assert_same_state(state_of(1), restored.state)
    return text


def _packed_file(config: DCSConfig) -> Path:
    manifest = load_manifest(step_dir(config, 2))
    name = manifest.tensors["data/ids"].file
    return step_dir(config, 2) / (name + ".zst")


@pytest.mark.parametrize("damage", ["flipped-byte", "truncated", "zeroed", "removed"])
def test_a_damaged_compressed_file_falls_back_to_the_previous_step(config: DCSConfig, damage: str) -> None:
    path = _packed_file(config)
    raw = bytearray(path.read_bytes())
    if damage == "flipped-byte":
        raw[len(raw) // 2] ^= 0x40
    elif damage == "truncated":
        raw = raw[: len(raw) - 100]
    elif damage == "zeroed":
        raw = bytearray(len(raw))
    if damage == "removed":
        path.unlink()
    else:
        path.write_bytes(bytes(raw))
    text = restore_falls_back(config)
    assert str(path) in text, text
    with Checkpointer(RUN, config) as ckpt, pytest.raises(CorruptCheckpoint) as info:
        ckpt.restore(step=2)
    assert str(path) in str(info.value)
    if damage != "flipped-byte":
        return  # `dcs ckpt verify` (a subprocess) once is enough
    done = dcs_ckpt(config, "verify", "--run", RUN)
    assert done.returncode == 1 and "step 1: ok" in done.stdout and "step 2: BAD" in done.stderr, done.stderr


def _edit(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(entry: dict[str, Any]) -> None:
        if value is None:
            entry.pop(key, None)
        else:
            entry[key] = value

    return edit


HOSTILE: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "unknown-codec": (_edit("compression", "lz4"), "has compression 'lz4', not one DCS reads"),
    "no-stored-size": (_edit("stored_size", None), "is compressed but records no stored size"),
    "stored-size-beyond-bound": (_edit("stored_size", 10**9), "cannot hold"),
    "stored-size-below-any-frame": (_edit("stored_size", 3), "cannot hold"),
    "stored-size-not-the-file": (lambda e: e.update(stored_size=e["stored_size"] + 1), "manifest says"),
    "size-not-the-frame": (lambda e: e.update(size=e["size"] + 64), "its zstd frame records"),
    "compression-dropped": (_edit("compression", None), "records a stored size but no compression"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_compression_fields_are_refused_with_a_named_error(config: DCSConfig, case: str) -> None:
    edit, reason = HOSTILE[case]
    name = _packed_file(config).name.removesuffix(".zst")
    path = step_dir(config, 2) / "manifest.json"
    manifest = json.loads(path.read_text())
    entry = next(f for f in manifest["files"] if f["name"] == name)
    edit(entry)  # size-not-the-frame: the tensors still fit, only the frame header can tell
    path.write_text(json.dumps(manifest))
    text = restore_falls_back(config)
    assert reason in text, text
    with Checkpointer(RUN, config) as ckpt, pytest.raises(CorruptCheckpoint, match=reason):
        ckpt.restore(step=2)
