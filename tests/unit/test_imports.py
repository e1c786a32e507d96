"""The original design's import paths work, and importing the packages stays light (torch loads on first use)."""

from __future__ import annotations

import subprocess
import sys


def test_seed_import_paths_resolve_to_the_client() -> None:
    import dcs_tasks
    from dcs_tasks.client import CheckpointEngineClient, create_client
    from dcs_tasks.client.engine import CheckpointEngineClient as Engine

    assert dcs_tasks.CheckpointEngineClient is Engine is CheckpointEngineClient
    assert dcs_tasks.create_client is create_client


def test_importing_the_packages_does_not_load_torch() -> None:
    code = "import sys, dcs_tasks, dcs_tasks.client, dcs_tasks.config; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "False"
