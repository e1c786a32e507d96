"""A worker moves a checkpoint's bytes without torch: its task modules import none, so `dcs worker` starts in
about a second instead of paying torch's import in every worker (and in every restart after a crash)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PROBE = textwrap.dedent(
    """
    import importlib.abc, sys

    class NoTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"{name} imported by the worker's modules")

    sys.meta_path.insert(0, NoTorch())
    from dcs_tasks.config import DCSConfig
    from workers.worker_app import make_worker_app

    app = make_worker_app(DCSConfig())
    app.loader.import_default_modules()
    import dcs_tasks.sync.group_bootstrap, workers.commit, workers.persist, workers.recovery, workers.memory
    import dcs_tasks.checkpoint.aftercommit, dcs_tasks.checkpoint.replicating, dcs_tasks.checkpoint.tiering
    import dcs_tasks.checkpoint.store.ledger.retention, dcs_tasks.checkpoint.store.ledger.latest
    print(sorted(name for name in app.tasks if name.startswith("dcs.")))
    """
)


def test_the_worker_and_its_tasks_import_without_torch() -> None:
    env = {"PYTHONPATH": str(REPO), "DCS_REDIS_URL": "redis://127.0.0.1:1/0", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "dcs.ckpt.persist" in done.stdout and "dcs.ckpt.commit" in done.stdout, done.stdout
