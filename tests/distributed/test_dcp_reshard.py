"""torch DCP through DCS across real gloo process groups: 4 ranks `dcp.save` DTensor shards (uneven row shards,
column shards, a replicated tensor, plain values) with `DCSStorageWriter`, each rank committing its part as a DCS
step (persisted and committed in its own process, `InlineCommitter`; real Redis); 2 ranks then `dcp.load` the step
with `DCSStorageReader` into their own, differently cut, DTensors: DCP reshards, DCS serves the chunks. Each
loading rank compares its local shards with `distribute_tensor(full)` bit for bit.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from dcs_tasks.config import DCSConfig
from tests.checkpoint_support import ckpt_config
from tests.helpers.ports import free_port
from tests.helpers.preloaded import python_module
from tests.helpers.procs import child_env

pytestmark = pytest.mark.distributed

SHAPES = {"w": (4099, 64), "tp": (24, 1030), "emb": (100, 16)}
PLACEMENTS = {"w": 0, "tp": 1, "emb": None}  # Shard(dim), None: Replicate


def full_tensor(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(sorted(SHAPES).index(name) + 11)
    t = torch.randn(SHAPES[name], generator=g)
    return t.to(torch.bfloat16) if name == "emb" else t


def _state(mesh: Any, zero: bool) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    model: dict[str, Any] = {}
    for name, dim in PLACEMENTS.items():
        full = torch.zeros_like(full_tensor(name)) if zero else full_tensor(name)
        model[name] = distribute_tensor(full, mesh, [Replicate() if dim is None else Shard(dim)])
    bias = torch.zeros(7) if zero else torch.arange(7.0)
    return {"model": {**model, "bias": bias}, "trainer": {"step": 0 if zero else 40, "name": "" if zero else "run"}}


def _child_main(job_path: str, rank_text: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from dcs_tasks.checkpoint.inline import InlineCommitter
    from dcs_tasks.integrations.dcp import DCSStorageReader, DCSStorageWriter

    job = json.loads(Path(job_path).read_text())
    rank, world = int(rank_text), job["world"]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{job['port']}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    config = DCSConfig()
    out: dict[str, Any] = {}
    if job["action"] == "save":
        committer = InlineCommitter(config)
        try:
            dcp.save(_state(mesh, zero=False), storage_writer=DCSStorageWriter("dcp", step=40, celery_app=committer))
        finally:
            committer.close()
    else:
        target = _state(mesh, zero=True)
        reader = DCSStorageReader("dcp", config=config)
        dcp.load(target, storage_reader=reader)
        out["step"] = reader.chosen_step
        out["same"] = {n: _bits(target["model"][n].to_local(), _expected(mesh, n)) for n in PLACEMENTS}
        out["bias"] = target["model"]["bias"].tolist()
        out["trainer"] = target["trainer"]
    Path(job["out"]).joinpath(f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def _expected(mesh: Any, name: str) -> torch.Tensor:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dim = PLACEMENTS[name]
    return distribute_tensor(full_tensor(name), mesh, [Replicate() if dim is None else Shard(dim)]).to_local()


def _bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# --- test side -----------------------------------------------------------------------------------------------


def run_group(config: DCSConfig, tmp_path: Path, tag: str, world: int, action: str) -> dict[int, Any]:
    out = tmp_path / tag
    out.mkdir()
    job_path = tmp_path / f"{tag}.json"
    job_path.write_text(json.dumps({"world": world, "port": free_port(), "out": str(out), "action": action}))
    env = child_env(config)
    procs = [
        python_module("tests.distributed.test_dcp_reshard", str(job_path), str(r), log=out / f"rank{r}.log", env=env)
        for r in range(world)
    ]
    try:
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert codes == [0] * world, [p.output() for p in procs]
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(world)}


def test_saved_at_4_ranks_loads_resharded_at_2(dcs_config: DCSConfig, tmp_path: Path) -> None:
    config = ckpt_config(dcs_config, tmp_path)
    run_group(config, tmp_path, "save", 4, "save")
    run_dir = Path(config.checkpoint.dir) / "dcp"
    manifests = [
        json.loads((run_dir / f"rank-{r:05d}" / "step-000000040" / "manifest.json").read_text()) for r in range(4)
    ]
    assert all(m["world_size"] == 4 and "dcp" in m["metadata"] for m in manifests)
    assert all((run_dir / f"rank-{r:05d}" / "latest").read_text().strip() == "step-000000040" for r in range(4))
    keys = [{item["key"] for item in m["metadata"]["dcp"]["items"]} for m in manifests]
    assert all(any(k.startswith("model.w@") for k in held) for held in keys)  # every rank wrote its row shard
    assert sum("model.emb" in held for held in keys) == 1  # the replicated tensor: written once (DCP deduplicates)

    loaded = run_group(config, tmp_path, "load", 2, "load")
    for rank, rep in loaded.items():
        assert rep["step"] == 40, rank
        assert all(rep["same"].values()), (rank, rep["same"])
        assert rep["bias"] == [float(i) for i in range(7)], rank
        assert rep["trainer"] == {"step": 40, "name": "run"}, rank


if __name__ == "__main__":
    warnings.filterwarnings("ignore", category=FutureWarning)
    _child_main(sys.argv[1], sys.argv[2])
