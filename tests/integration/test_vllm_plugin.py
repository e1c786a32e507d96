"""DCS's vLLM plugin (plugins/vllm-dcs) as a user installs it: vLLM finds backend "dcs" only through the
`vllm.general_plugins` entry point of the installed distribution (`make vllm-engines` ran `pip install
plugins/vllm-dcs` into .vllm/plugins, next to vLLM 0.33.0 under .vllm/). Each check runs vLLM's own code in a
fresh interpreter whose path is the vLLM environment only (no DCS, no tests/)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.vllm_engine.harness import NEWEST, VLLM_ROOT, installed

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]
if not installed():
    pytestmark.append(pytest.mark.skip(reason="vLLM not installed under .vllm/ (make vllm-engines)"))

PROBE = textwrap.dedent(
    """
    import importlib.metadata, json, sys
    import torch
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory as factory
    from vllm.plugins import load_general_plugins

    out = {"before": "dcs" in factory._registry}
    out["entry_points"] = sorted(
        [e.name, e.value, e.dist.name if e.dist else None]
        for e in importlib.metadata.entry_points(group="vllm.general_plugins")
    )
    load_general_plugins()
    out["after"] = "dcs" in factory._registry
    config = WeightTransferConfig(backend="dcs")
    try:
        engine = factory.create_engine(config, VllmConfig(weight_transfer_config=config), torch.device("cpu"),
                                       torch.nn.Linear(2, 2))
    except ValueError as exc:
        out["create"] = str(exc)
        print(json.dumps(out)); sys.exit(0)
    cls = type(engine)
    out["create"] = f"{cls.__module__}.{cls.__name__}"
    out["engine_file"] = sys.modules[cls.__module__].__file__
    import vllm_dcs
    vllm_dcs.register(); vllm_dcs.register()  # a second load of the plugin in one process: no error
    try:
        factory.register_engine("dcs", "elsewhere", "Engine")
        out["duplicate"] = "accepted"
    except ValueError as exc:  # vLLM's own rule, which register() respects
        out["duplicate"] = str(exc)
    base = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2}
    refusals = {}
    for name, extra in (("mpi", {"transport": "mpi"}), ("nccl_on_cpu", {"transport": "nccl"})):
        try:
            engine.init_transfer_engine(engine.parse_init_info({**base, **extra}))
            refusals[name] = "accepted"
        except ValueError as exc:
            refusals[name] = str(exc)
    out["refusals"] = refusals
    print(json.dumps(out))
    """
)


def probes(tmp_path: Path, *paths: list[Path]) -> list[dict[str, object]]:
    """PROBE's answer in one fresh interpreter per entry of `paths`, whose imports come from those directories
    (and the venv's torch) only; the interpreters run at the same time (each imports vLLM: seconds of CPU)."""
    running = []
    try:
        for i, dirs in enumerate(paths):
            env = {k: v for k, v in os.environ.items() if not k.startswith(("DCS_", "VLLM_", "PYTHON"))}
            env.update(PYTHONPATH=os.pathsep.join(map(str, dirs)), VLLM_TARGET_DEVICE="cpu")
            out, err = tmp_path / f"probe{i}.out", tmp_path / f"probe{i}.err"
            with out.open("wb") as stdout, err.open("wb") as stderr:
                proc = subprocess.Popen(
                    [sys.executable, "-c", PROBE], env=env, cwd=tmp_path, stdout=stdout, stderr=stderr
                )
            running.append((proc, out, err))
        answers = []
        for proc, out, err in running:
            assert proc.wait(300) == 0, err.read_text(errors="replace")[-3000:]
            answers.append(json.loads(out.read_text().strip().splitlines()[-1]))
        return answers
    finally:
        for proc, _, _ in running:
            proc.kill()
            proc.wait()


def test_vllm_loads_backend_dcs_from_the_installed_plugins_entry_point_only(tmp_path: Path) -> None:
    vllm_env = [VLLM_ROOT / NEWEST, VLLM_ROOT / "deps"]
    # the second: the same vLLM without the plugin installed
    found, without = probes(tmp_path, [*vllm_env, VLLM_ROOT / "plugins"], vllm_env)
    assert ["dcs", "vllm_dcs:register", "vllm-dcs"] in found["entry_points"]
    assert found["before"] is False and found["after"] is True  # registered by loading the general plugins
    assert found["create"] == "vllm_dcs.engine.DCSWeightTransferEngine"
    assert Path(str(found["engine_file"])).is_relative_to(VLLM_ROOT / "plugins")  # the installed copy
    assert "already registered" in str(found["duplicate"])
    refusals = found["refusals"]
    assert isinstance(refusals, dict)
    assert "transport 'mpi' is not one of gloo, nccl" in refusals["mpi"]
    assert "transport 'nccl' receives on the worker's CUDA device" in refusals["nccl_on_cpu"]

    # the same vLLM without the plugin installed: no backend "dcs"
    assert not any(name == "dcs" for name, _, _ in without["entry_points"])  # type: ignore[union-attr]
    assert without["after"] is False
    assert "Invalid weight transfer backend: dcs" in str(without["create"])
