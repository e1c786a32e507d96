"""DTensor checkpoints across real gloo process groups, a real redis-server and a real `dcs worker`.

Each group is W subprocesses (`python -m tests.distributed.test_checkpoint_dtensor JOB RANK`) that build the
same global tensors, `distribute_tensor` them on a DeviceMesh (torch's own sharding, so uneven shards are
`torch.chunk`'s), and save or restore through `Checkpointer`. Restoring ranks compare their local shard with
`distribute_tensor(full)` and the gathered `full_tensor()` with the full tensor, bit for bit, and report the
checkpoint bytes they read (DCS's counter and /proc/self/io `rchar`).

One `dcs worker` serves the whole file (each test saves runs of its own names, in one Redis database and checkpoint
directory of the module's); none of these tests looks at the worker itself, and it is discarded after the last.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from dcs_tasks import Checkpointer
from dcs_tasks.checkpoint.format.layout import SUM_CHUNK_BYTES
from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import CheckpointNotFound, CorruptCheckpoint
from tests.checkpoint_support import ckpt_config
from tests.helpers.module_worker import module_worker
from tests.helpers.ports import free_port
from tests.helpers.preloaded import python_module
from tests.helpers.procs import child_env
from tests.helpers.redis_server import RedisServer

pytestmark = pytest.mark.distributed

ROWS = 16385  # FSDP weight: 4 ranks hold 4097/4097/4097/4094 rows (torch.chunk), 8 ranks 2049 each, the last 2042
SHAPES = {"w": (ROWS, 256), "tp": (40, 8195), "emb": (1000, 64), "bias": (ROWS,), "norm": (512,), "ids": (10,)}
LAYOUTS: dict[str, dict[str, list[str]]] = {
    # one entry per mesh dimension: "S0"/"S1" = Shard(d), "R" = Replicate()
    "fsdp": {"w": ["S0"], "tp": ["S1"], "emb": ["R"], "bias": ["R"], "norm": ["R"], "ids": ["S0"]},
    "cross": {"w": ["S0"], "tp": ["S0"], "emb": ["S1"], "bias": ["R"], "norm": ["S0"], "ids": ["R"]},
    "2d": {
        "w": ["S0", "S1"],
        "tp": ["S1", "R"],
        "emb": ["R", "S0"],
        "bias": ["R", "R"],
        "norm": ["S0", "S0"],
        "ids": ["S0", "S0"],
    },
    "1x4": {
        "w": ["S0", "S1"],
        "tp": ["R", "S1"],
        "emb": ["R", "S1"],
        "bias": ["R", "S0"],
        "norm": ["R", "R"],
        "ids": ["R", "S0"],
    },
}


def full_tensor(name: str, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step * 100 + sorted(SHAPES).index(name))
    if name == "ids":
        return torch.randint(0, 1 << 40, SHAPES[name], generator=g, dtype=torch.int64)
    t = torch.randn(SHAPES[name], generator=g)
    return t.to(torch.bfloat16) if name == "emb" else t


# --- child side --------------------------------------------------------------------------------------------


def _placements(codes: list[str]) -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate() if c == "R" else Shard(int(c[1:])) for c in codes]


def _state(mesh: Any, layout: str, step: int, rank: int, names: list[str] | None = None) -> dict[str, Any]:
    from torch.distributed.tensor import distribute_tensor

    model = {
        n: distribute_tensor(full_tensor(n, step), mesh, _placements(LAYOUTS[layout][n]))
        for n in sorted(names or SHAPES)
    }
    return {"model": model, "rng": torch.full((4,), float(rank * 100 + step)), "step": step}


def _rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    return 0


def _child_save(job: dict[str, Any], rank: int, mesh: Any) -> dict[str, Any]:
    from dcs_tasks import Checkpointer
    from dcs_tasks.checkpoint.checkpointer import Checkpointer as Impl

    states: dict[int, Any] = {}  # data step -> the state: unchanged data is the same tensors, as a model's are
    with Checkpointer(job["run"], rank=rank, world_size=job["world"]) as ckpt:
        for step in job["steps"]:
            if step == job.get("kill_step") and rank == job.get("kill_rank"):

                def die(*_: Any) -> None:  # staged and opened in the ledger, persist tasks never sent
                    os.kill(os.getpid(), signal.SIGKILL)

                Impl._send = die  # type: ignore[method-assign]
            data = job.get("data_step", step)  # a save of unchanged data (incremental saves refer to it)
            if data not in states:
                states[data] = _state(mesh, job["layout"], data, rank)
            pending = ckpt.save(states[data], step)
            pending.wait(timeout=120)
    return {"saved": job["steps"]}


def _child_restore(job: dict[str, Any], rank: int, mesh: Any) -> dict[str, Any]:
    from torch.distributed.tensor import distribute_tensor

    from dcs_tasks import Checkpointer
    from dcs_tasks.checkpoint.restore import boxread

    step, layout, out = job["step"], job["layout"], {}
    with Checkpointer(job["run"], rank=rank, world_size=job["world"]) as ckpt:
        if job.get("partial"):  # only the FSDP weight, into a state holding nothing else (strict=False)
            target = {"model": {"w": distribute_tensor(torch.zeros(SHAPES["w"]), mesh, _placements(["S0"]))}}
            before, rchar = boxread.bytes_read_total(), _rchar()
            restored = ckpt.restore(into=target, strict=False)
            out["partial_read"] = boxread.bytes_read_total() - before
            out["partial_rchar"] = _rchar() - rchar
            w = target["model"]["w"]
            out["partial_local_bytes"] = w.to_local().numel() * 4
            out["partial_same"] = restored.state is target and _bits(w.to_local(), _expected(mesh, "w", layout, step))
        target = _state(mesh, layout, 0, rank)
        for t in target["model"].values():
            t.to_local().zero_()
        before, rchar = boxread.bytes_read_total(), _rchar()
        restored = ckpt.restore(into=target)
        out["read"], out["rchar"] = boxread.bytes_read_total() - before, _rchar() - rchar
    out["step"] = restored.state["step"]
    out["rng"] = restored.state["rng"].tolist()
    out["needed"] = sum(t.to_local().numel() * t.element_size() for t in target["model"].values()) + 16
    out["local_ok"] = {n: _bits(t.to_local(), _expected(mesh, n, layout, step)) for n, t in target["model"].items()}
    out["full_ok"] = {
        n: _bits(t.full_tensor(), full_tensor(n, step)) for n, t in sorted(restored.state["model"].items())
    }
    out["same_objects"] = all(restored.state["model"][n] is target["model"][n] for n in target["model"])
    return out


def _expected(mesh: Any, name: str, layout: str, step: int) -> torch.Tensor:
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full_tensor(name, step), mesh, _placements(LAYOUTS[layout][name])).to_local()


def _bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_raw(a), _raw(b))


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _child_refuse(job: dict[str, Any], rank: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import Partial, _StridedShard

    from dcs_tasks import Checkpointer

    flat = init_device_mesh("cpu", (1,))
    cube = init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("a", "b", "c"))
    local = torch.ones(4, 4)
    cases = {
        "partial": {"model": {"p": DTensor.from_local(local, flat, [Partial()])}},
        "strided": {"model": {"s": DTensor.from_local(local, flat, [_StridedShard(0, split_factor=2)])}},
        "mesh3d": {"model": {"c": DTensor.from_local(local, cube, [Shard(0), Shard(1), Shard(0)])}},
    }
    out: dict[str, Any] = {}
    with Checkpointer(job["run"], rank=rank, world_size=1) as ckpt:
        for i, (case, state) in enumerate(cases.items()):
            try:
                ckpt.save(state, i + 1)
                out[case] = None
            except Exception as exc:
                out[case] = [type(exc).__name__, str(exc)]
        out["committed"] = [info.step for info in ckpt.list()]
    return out


def _child_main(job_path: str, rank_text: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    job = json.loads(Path(job_path).read_text())
    rank = int(rank_text)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{job['port']}", rank=rank, world_size=job["world"])
    if job["action"] == "refuse":
        result = _child_refuse(job, rank)
    else:
        mesh = init_device_mesh("cpu", tuple(job["mesh"]))
        result = _child_save(job, rank, mesh) if job["action"] == "save" else _child_restore(job, rank, mesh)
    Path(job["out"]).joinpath(f"rank{rank}.json").write_text(json.dumps(result))
    if not job.get("kill_step"):
        dist.destroy_process_group()


# --- parent side -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def config(
    shared_redis: tuple[RedisServer, Iterator[int]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DCSConfig]:
    """The module's config (as `dcs_config` makes a test's: a database of its own on the shared redis-server, short
    heartbeats, a private checkpoint directory) and the one worker that serves it (`tests.helpers.module_worker`)."""
    with module_worker(shared_redis, tmp_path_factory, "dtensor", prepare=ckpt_config) as served:
        yield served.config


def run_group(config: DCSConfig, tmp_path: Path, tag: str, world: int, **job: Any) -> dict[int, Any]:
    """Run one gloo group of `world` processes on `job`; rank -> its report (killed ranks report nothing)."""
    out = tmp_path / tag
    out.mkdir()
    job.update(world=world, port=free_port(), out=str(out))
    job_path = tmp_path / f"{tag}.json"
    job_path.write_text(json.dumps(job))
    env = child_env(config)
    procs = [
        python_module(
            "tests.distributed.test_checkpoint_dtensor", str(job_path), str(r), log=out / f"rank{r}.log", env=env
        )
        for r in range(world)
    ]
    try:
        codes = [p.wait(timeout=400) for p in procs]
    finally:
        for p in procs:
            p.kill()
    killed = job.get("kill_rank") if job.get("kill_step") else None
    assert codes == [-signal.SIGKILL if r == killed else 0 for r in range(world)], [p.output() for p in procs]
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(world) if r != killed}


def holders(config: DCSConfig, run: str, step: int, world: int) -> dict[str, list[int]]:
    """Tensor name -> the saving ranks whose manifest of `step` holds it."""
    found: dict[str, list[int]] = {}
    for r in range(world):
        path = Path(config.checkpoint.dir) / run / f"rank-{r:05d}" / f"step-{step:09d}" / "manifest.json"
        for name in json.loads(path.read_text())["tensors"]:
            found.setdefault(name, []).append(r)
    return found


def check_restored(reports: dict[int, Any], step: int, saved_world: int) -> None:
    for rank, rep in reports.items():
        assert rep["step"] == step
        assert all(rep["local_ok"].values()), (rank, rep["local_ok"])
        assert all(rep["full_ok"].values()), (rank, rep["full_ok"])
        assert rep["same_objects"], rank
        local = rank if rank < saved_world else 0
        assert rep["rng"] == [float(local * 100 + step)] * 4


def test_fsdp_and_tp_shards_restore_at_2_3_and_8_ranks(config: DCSConfig, tmp_path: Path) -> None:
    run_group(config, tmp_path, "save", 4, action="save", run="fsdp", mesh=[4], layout="fsdp", steps=[10])
    held = holders(config, "fsdp", 10, 4)
    for name in ("w", "tp", "ids"):  # sharded: every rank writes its own shard
        assert held[f"model/{name}"] == [0, 1, 2, 3], name
    replicated = [held[f"model/{name}"] for name in ("emb", "bias", "norm")]
    assert all(len(ranks) == 1 for ranks in replicated), replicated  # written once across the ranks
    assert len({ranks[0] for ranks in replicated}) > 1, replicated  # and not all by the same rank

    check_restored(
        run_group(config, tmp_path, "w2", 2, action="restore", run="fsdp", mesh=[2], layout="fsdp", step=10), 10, 4
    )
    check_restored(
        run_group(config, tmp_path, "w3", 3, action="restore", run="fsdp", mesh=[3], layout="cross", step=10), 10, 4
    )
    eight = run_group(
        config, tmp_path, "w8", 8, action="restore", run="fsdp", mesh=[8], layout="fsdp", step=10, partial=True
    )
    check_restored(eight, 10, 4)
    whole_part = 4097 * 256 * 4  # one saving rank's shard of w
    for rank, rep in eight.items():
        assert rep["partial_same"], rank
        # half a saved shard, read from one or two saving ranks: at most one checksum chunk of slack per end
        slack = 4 * SUM_CHUNK_BYTES
        assert rep["partial_read"] <= rep["partial_local_bytes"] + slack < whole_part, (rank, rep)
        assert rep["partial_rchar"] <= rep["partial_local_bytes"] + slack + 256 * 1024, (rank, rep)


def test_an_unchanged_dtensor_step_refers_to_the_earlier_files_and_restores_through_them(
    config: DCSConfig, tmp_path: Path
) -> None:
    job = {"action": "save", "run": "same", "mesh": [4], "layout": "fsdp", "steps": [10, 20], "data_step": 10}
    run_group(config, tmp_path, "save", 4, **job)
    for r in range(4):
        manifest = Path(config.checkpoint.dir) / "same" / f"rank-{r:05d}" / "step-000000020" / "manifest.json"
        files = json.loads(manifest.read_text())["files"]
        assert files and all(f.get("source_step") == 10 for f in files), (r, files)
    # the newest step (20, all references) restored on 3 ranks as Shard(0) and Shard(1): chunk reads follow them
    reports = run_group(config, tmp_path, "w3", 3, action="restore", run="same", mesh=[3], layout="cross", step=10)
    check_restored(reports, 10, 4)


def test_2d_mesh_2x2_restores_on_1x4(config: DCSConfig, tmp_path: Path) -> None:
    run_group(config, tmp_path, "save", 4, action="save", run="mesh", mesh=[2, 2], layout="2d", steps=[10])
    held = holders(config, "mesh", 10, 4)
    assert len(held["model/w"]) == 4 and len(held["model/bias"]) == 1
    assert len(held["model/tp"]) == 2 and len(held["model/emb"]) == 2  # one writer per replicated pair
    check_restored(
        run_group(config, tmp_path, "r", 4, action="restore", run="mesh", mesh=[1, 4], layout="1x4", step=10), 10, 4
    )


def test_a_rank_killed_mid_save_leaves_the_step_out(config: DCSConfig, tmp_path: Path) -> None:
    run_group(
        config,
        tmp_path,
        "save",
        4,
        action="save",
        run="kill",
        mesh=[4],
        layout="fsdp",
        steps=[10, 20],
        kill_step=20,
        kill_rank=2,
    )
    with Checkpointer("kill", config) as ckpt:
        with pytest.raises(CheckpointNotFound, match=r"only ranks \[0, 1, 3\] committed it"):
            ckpt.restore(step=20)
        restored = ckpt.restore()  # no target: the DTensors come back whole, as plain tensors
    assert restored.step == 10
    for name in SHAPES:
        got = restored.state["model"][name]
        assert type(got) is torch.Tensor and _bits(got, full_tensor(name, 10)), name


def test_a_flipped_byte_fails_only_reads_of_its_chunk(config: DCSConfig, tmp_path: Path) -> None:
    run_group(config, tmp_path, "save", 2, action="save", run="flip", mesh=[2], layout="fsdp", steps=[10, 20])
    step_dir = Path(config.checkpoint.dir) / "flip" / "rank-00001" / "step-000000020"
    entry = json.loads((step_dir / "manifest.json").read_text())["tensors"]["model/w"]
    with (step_dir / entry["file"]).open("r+b") as f:  # a byte in chunk 1 of rank 1's shard of w
        f.seek(entry["offsets"][0] + SUM_CHUNK_BYTES + 5)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x10]))
    with Checkpointer("flip", config) as ckpt:
        with pytest.raises(CorruptCheckpoint, match=r"chunk 1 of tensor 'model/w' fails its checksum"):
            ckpt.restore(step=20)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            assert ckpt.restore().step == 10  # the newest step that verifies
        assert any("step 20 is corrupt" in str(w.message) for w in seen)
        # tensors whose chunks do not hold the flipped byte still restore from step 20 (only read bytes are verified)
        part = {"model": {"norm": torch.zeros(512), "ids": torch.zeros(10, dtype=torch.int64)}}
        assert ckpt.restore(step=20, into=part, strict=False).state is part
    assert _bits(part["model"]["norm"], full_tensor("norm", 20)) and _bits(part["model"]["ids"], full_tensor("ids", 20))


def test_unsupported_placements_are_refused_by_name(config: DCSConfig, tmp_path: Path) -> None:
    rep = run_group(config, tmp_path, "refuse", 1, action="refuse", run="refuse")[0]
    assert rep["partial"][0] == "UnsupportedPlacement" and "'model/p'" in rep["partial"][1]
    assert "P(sum)" in rep["partial"][1] or "Partial" in rep["partial"][1]
    assert rep["strided"][0] == "UnsupportedPlacement" and "'model/s'" in rep["strided"][1]
    assert "_S(" in rep["strided"][1] or "StridedShard" in rep["strided"][1]
    assert rep["mesh3d"][0] == "UnsupportedPlacement" and "'model/c'" in rep["mesh3d"][1]
    assert "3 dimensions" in rep["mesh3d"][1]
    assert rep["committed"] == []


if __name__ == "__main__":
    _child_main(*sys.argv[1:3])
