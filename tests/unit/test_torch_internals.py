"""The import-time check of the private torch.distributed internals DCS's process groups use
(dcs_tasks/backends/process_group.py): silent on the installed torch, a TorchInternalsMissing naming the torch version
and the missing internal when one is gone (taken away in a forked process before the module is imported anew)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from dcs_tasks.backends import process_group
from tests.helpers.preloaded import run_module

ROOT = Path(__file__).resolve().parents[2]


def test_the_installed_torch_has_every_internal_used() -> None:
    assert process_group.missing_torch_internals() == []
    process_group.check_torch_internals()


def _import_after(change: str, workdir: Path) -> subprocess.CompletedProcess[str]:
    """Import the backend module anew after `change` (Python run on torch's c10d module, `c`), in a process of its
    own forked from the preloaded forkserver (torch imported already; the module is dropped and imported again)."""
    code = (
        "import sys\n"
        "from torch.distributed import distributed_c10d as c\n"
        f"{change}\n"
        "sys.modules.pop('dcs_tasks.backends.process_group', None)\n"
        "try:\n"
        "    import dcs_tasks.backends.process_group\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return run_module("tests.helpers.code_main", code, workdir=workdir, env=env, timeout=120)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ("del c._new_process_group_helper", "distributed_c10d._new_process_group_helper"),
        ("c._world = object()", "distributed_c10d._world.pg_group_ranks"),
        ("c._new_process_group_helper = lambda *a, timeout=None: None", "_new_process_group_helper(group_name=...)"),
    ],
)
def test_a_missing_internal_fails_the_import_naming_it_and_the_torch_version(
    change: str, named: str, tmp_path: Path
) -> None:
    done = _import_after(change, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("TorchInternalsMissing torch " + torch.__version__), done.stdout
    assert named in done.stdout and "torch>=2.13" in done.stdout
