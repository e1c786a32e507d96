"""torch DCP through DCS (`dcs_tasks.integrations.dcp`): `dcp.save`/`async_save` with `DCSStorageWriter` commit a
DCS step (manifest, checksums, `latest`) that `dcp.load` with `DCSStorageReader`, `Checkpointer.restore`, `dcs ckpt`
and, after `dcs ckpt export --format dcp`, DCP's own `FileSystemReader` all read. Real Redis; the in-process
committer where no worker process is needed, a real `dcs worker` in one test."""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from dcs_tasks import Checkpointer
from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import CorruptCheckpoint
from dcs_tasks.integrations.dcp import DCSStorageReader, DCSStorageWriter, UnstorableItem
from dcs_tasks.interop.dcp_steps import MAX_BYTES_ITEM
from tests.checkpoint_support import Inline, ckpt_config, dcs_ckpt
from tests.helpers.procs import WorkerProcess

pytestmark = [
    pytest.mark.integration,
    # one process, no process group: DCP warns that it assumes a single process, as intended here
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
]


def model_and_optimizer(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, 16)).sum().backward()
    optimizer.step()  # the optimizer now holds tensors (moments) and plain values (step counts, hyperparameters)
    return model, optimizer


def app_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": optimizer.state_dict(), "extra": {"epoch": 3, "note": "dcs"}}


@pytest.fixture
def config(dcs_config: DCSConfig, tmp_path: Path) -> DCSConfig:
    return ckpt_config(dcs_config, tmp_path)


@pytest.fixture
def ckpt(config: DCSConfig, inline: Inline) -> Iterator[Checkpointer]:
    with Checkpointer("dcp", config, celery_app=inline(config)) as made:
        yield made


def assert_states_equal(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_states_equal(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_states_equal(x, y)
    else:
        assert a == b


def test_dcp_save_commits_a_dcs_step_that_dcp_load_and_checkpointer_restore_read(
    config: DCSConfig, ckpt: Checkpointer, inline: Inline
) -> None:
    model, optimizer = model_and_optimizer(0)
    saved = app_state(model, optimizer)
    dcp.save(saved, storage_writer=DCSStorageWriter(ckpt, step=7))

    # a committed DCS step: manifest with checksums, `latest`
    step_dir = Path(config.checkpoint.dir) / "dcp" / "step-000000007"
    manifest = json.loads((step_dir / "manifest.json").read_text())
    assert all(len(f["checksum"]) == 32 for f in manifest["files"])
    assert (step_dir.parent / "latest").read_text().strip() == "step-000000007"
    assert (
        "dcp" in manifest["metadata"] and not list(step_dir.glob("*.distcp")) and not (step_dir / ".metadata").exists()
    )

    # DCP loads it into a fresh model and optimizer
    fresh_model, fresh_opt = model_and_optimizer(1)
    into = app_state(fresh_model, fresh_opt)
    reader = DCSStorageReader("dcp", config=config)
    dcp.load(into, storage_reader=reader)
    assert reader.chosen_step == 7
    fresh_model.load_state_dict(into["model"])
    fresh_opt.load_state_dict(into["optim"])
    assert_states_equal(saved["model"], fresh_model.state_dict())
    assert_states_equal(saved["optim"], fresh_opt.state_dict())
    assert into["extra"] == {"epoch": 3, "note": "dcs"}

    # Checkpointer.restore reads the same step: tensors by their DCP names
    restored = ckpt.restore().state
    assert restored["model.0.weight"].equal(model.state_dict()["0.weight"])
    assert restored["optim.state.0.exp_avg"].equal(optimizer.state_dict()["state"][0]["exp_avg"])

    # dcs ckpt lists and verifies it
    listed = dcs_ckpt(config, "list", "--run", "dcp")
    assert listed.returncode == 0 and "7" in listed.stdout, listed.stdout + listed.stderr
    verified = dcs_ckpt(config, "verify", "--run", "dcp")
    assert verified.returncode == 0, verified.stdout + verified.stderr
    inspected = dcs_ckpt(config, "inspect", "--run", "dcp", "--step", "7")
    assert inspected.returncode == 0 and "model.0.weight" in inspected.stdout, inspected.stdout + inspected.stderr


def test_async_save_returns_before_the_step_is_durable_and_its_future_after(
    config: DCSConfig, ckpt: Checkpointer
) -> None:
    model, optimizer = model_and_optimizer(2)
    saved = app_state(model, optimizer)
    future = dcp.async_save(saved, storage_writer=DCSStorageWriter(ckpt, step=1))
    future.result(timeout=120)
    assert [info.step for info in ckpt.list()] == [1]
    into = app_state(*model_and_optimizer(3))
    dcp.load(into, storage_reader=DCSStorageReader("dcp", step=1, config=config))
    assert_states_equal(saved["model"], into["model"])


def snapshot(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: snapshot(v) for k, v in value.items()}
    if isinstance(value, list):
        return [snapshot(v) for v in value]
    return value


def mutate(state: dict[str, Any]) -> None:
    """What a trainer does right after `async_save` returns: every tensor changed in place, plain values too."""
    for value in state["model"].values():
        value.add_(1.0)
    for moments in state["optim"]["state"].values():
        for value in moments.values():
            if isinstance(value, torch.Tensor):
                value.mul_(-3.0)
    state["optim"]["param_groups"][0]["lr"] = 123.0
    state["extra"]["epoch"] = 99


def in_staging(ckpt: Checkpointer, t: torch.Tensor) -> bool:
    for buf in ckpt.staging_buffers:
        if buf.view is not None and buf.view.data_ptr() <= t.data_ptr() < buf.view.data_ptr() + buf.capacity:
            return True
    return False


def test_async_save_stages_into_dcs_staging_and_commits_the_state_at_the_call(
    config: DCSConfig, ckpt: Checkpointer
) -> None:
    model, optimizer = model_and_optimizer(8)
    state = app_state(model, optimizer)
    at_call = snapshot(state)
    writer = DCSStorageWriter(ckpt, step=11)
    future = dcp.async_save(state, storage_writer=writer)  # DCP stages through the writer (its AsyncStager)
    mutate(state)
    future.result(timeout=120)

    into = app_state(*model_and_optimizer(9))
    dcp.load(into, storage_reader=DCSStorageReader("dcp", step=11, config=config))
    assert_states_equal(at_call["model"], into["model"])
    _model, fresh_opt = model_and_optimizer(10)
    fresh_opt.load_state_dict(into["optim"])
    assert_states_equal(at_call["optim"], fresh_opt.state_dict())
    assert into["extra"] == {"epoch": 3, "note": "dcs"}
    # the manifest keeps DCP's map of the nested state, not the flat staged one
    manifest = json.loads((Path(config.checkpoint.dir) / "dcp" / "step-000000011" / "manifest.json").read_text())
    assert ["model.0.weight", ["model", "0.weight"]] in manifest["metadata"]["dcp"]["planner_data"]

    # what DCP's save path reads is DCS's staged copy (no copy of DCP's own): every tensor over a staging buffer
    try:
        staged = writer.stage(app_state(model, optimizer))
        tensors = [v for v in staged.values() if isinstance(v, torch.Tensor)]
        assert len(tensors) == 16 and all(in_staging(ckpt, t) for t in tensors)  # 4 weights, 4 x (2 moments, step)
    finally:
        writer.close()  # gives the staged copy back unsaved
    ckpt.save({"w": torch.ones(2)}, 12).wait(timeout=60)


class CloningPlanner(DefaultSavePlanner):
    """A planner that hands the writer other tensors than the staged ones (as a planner transforming values does)."""

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:
        if write_item.type == WriteItemType.BYTE_IO:
            return super().transform_object(write_item, object)
        return object.clone()


def test_async_save_whose_plan_is_not_what_was_staged_copies_it_and_gives_the_buffer_back(
    config: DCSConfig, dcs_config: DCSConfig, tmp_path: Path, inline: Inline
) -> None:
    one_buffer = ckpt_config(dcs_config, tmp_path, staging_buffers=1)
    with Checkpointer("cloned", one_buffer, celery_app=inline(one_buffer)) as ckpt:
        for step in (1, 2):  # the second save needs the only buffer back
            state = app_state(*model_and_optimizer(step))
            at_call = snapshot(state)
            future = dcp.async_save(state, storage_writer=DCSStorageWriter(ckpt, step=step), planner=CloningPlanner())
            mutate(state)
            future.result(timeout=120)
            into = app_state(*model_and_optimizer(20))
            dcp.load(into, storage_reader=DCSStorageReader("cloned", step=step, config=one_buffer))
            assert_states_equal(at_call["model"], into["model"])


def test_a_writer_given_a_run_name_makes_and_closes_its_own_checkpointer(config: DCSConfig, inline: Inline) -> None:
    committer = inline(config)
    state = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(3, dtype=torch.bfloat16)}
    dcp.save(state, storage_writer=DCSStorageWriter("named", step=2, config=config, celery_app=committer))
    into = {"w": torch.zeros(3, 4), "b": torch.zeros(3, dtype=torch.bfloat16)}
    dcp.load(into, checkpoint_id="dcs://named/2", storage_reader=DCSStorageReader("named", config=config))
    assert_states_equal(state, into)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning")
@pytest.mark.parametrize("given", ["checkpointer", "run name"])
def test_a_state_dcs_cannot_store_is_refused_naming_the_key_and_nothing_is_committed(
    config: DCSConfig, ckpt: Checkpointer, inline: Inline, given: str
) -> None:
    state = {"fine": torch.ones(4), "half_complex": torch.zeros(4, dtype=torch.complex32)}
    if given == "checkpointer":
        writer = DCSStorageWriter(ckpt, step=5)
    else:
        writer = DCSStorageWriter("dcp", step=5, config=config, celery_app=inline(config))
    with pytest.raises(CheckpointException) as raised:
        dcp.save(state, storage_writer=writer)
    errors = [exc for exc, _trace in raised.value.failures.values()]
    assert len(errors) == 1 and isinstance(errors[0], UnstorableItem)
    assert errors[0].key == "half_complex" and "complex32" in str(errors[0])
    assert ckpt.list() == []
    assert not (Path(config.checkpoint.dir) / "dcp" / "step-000000005").exists()


def test_a_value_over_the_blob_bound_is_refused_naming_the_key_and_nothing_is_committed(
    config: DCSConfig, ckpt: Checkpointer
) -> None:
    state = {"w": torch.ones(4), "tokenizer": {"vocab": b"x" * MAX_BYTES_ITEM}}  # serialised: a little more
    with pytest.raises(CheckpointException) as raised:
        dcp.save(state, storage_writer=DCSStorageWriter(ckpt, step=6))
    errors = [exc for exc, _trace in raised.value.failures.values()]
    assert len(errors) == 1 and isinstance(errors[0], UnstorableItem) and errors[0].key == "tokenizer.vocab"
    assert ckpt.list() == []


def test_a_corrupt_file_fails_the_load_naming_it(config: DCSConfig, ckpt: Checkpointer) -> None:
    dcp.save({"w": torch.arange(4096.0)}, storage_writer=DCSStorageWriter(ckpt, step=3))
    data = next((Path(config.checkpoint.dir) / "dcp" / "step-000000003").glob("*.safetensors"))
    raw = bytearray(data.read_bytes())
    raw[-5] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointException) as raised:
        dcp.load({"w": torch.zeros(4096)}, storage_reader=DCSStorageReader("dcp", config=config))
    errors = [exc for exc, _trace in raised.value.failures.values()]
    assert isinstance(errors[0], CorruptCheckpoint) and data.name in str(errors[0])


def test_export_as_dcp_loads_with_dcps_own_filesystem_reader(
    config: DCSConfig, ckpt: Checkpointer, tmp_path: Path
) -> None:
    model, optimizer = model_and_optimizer(4)
    saved = app_state(model, optimizer)
    dcp.save(saved, storage_writer=DCSStorageWriter(ckpt, step=9))
    out = tmp_path / "exported"
    done = dcs_ckpt(config, "export", "--run", "dcp", "--format", "dcp", "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    assert (out / ".metadata").is_file()
    into = app_state(*model_and_optimizer(5))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        dcp.load(into, storage_reader=FileSystemReader(str(out)))  # DCP's own reader, as a user loads it
    assert_states_equal(saved, into)


def test_dcp_save_through_a_real_worker(config: DCSConfig, tmp_path: Path) -> None:
    worker = WorkerProcess(config, tmp_path / "worker.log").start()
    try:
        model, optimizer = model_and_optimizer(6)
        saved = app_state(model, optimizer)
        dcp.save(saved, storage_writer=DCSStorageWriter("worked", step=4, config=config))
        into = app_state(*model_and_optimizer(7))
        dcp.load(into, storage_reader=DCSStorageReader("worked", config=config))
        assert_states_equal(saved, into)
    finally:
        worker.discard()
    assert "persisted" in (tmp_path / "worker.log").read_text()
