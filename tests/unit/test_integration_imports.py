"""DCS does not depend on the frameworks it integrates with: importing DCS's packages (the trainer's API, the
checkpoint package, the client, the CLI, the worker and its tasks) loads neither Lightning nor transformers nor
accelerate, and no module outside `dcs_tasks/integrations/` imports that package. Only a user's
`import dcs_tasks.integrations.<framework>` brings its framework in."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from tests.unit.importgraph import files_of, imports_of, where

REPO = Path(__file__).resolve().parents[2]
FRAMEWORKS = ("lightning", "pytorch_lightning", "lightning_fabric", "transformers", "accelerate")

PROBE = textwrap.dedent(
    f"""
    import importlib.abc, sys

    class NoFrameworks(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] in {FRAMEWORKS!r}:
                raise ImportError(f"{{name}} imported")

    sys.meta_path.insert(0, NoFrameworks())
    import dcs_tasks, dcs_tasks.checkpoint, dcs_tasks.client, dcs_tasks.interop, dcs_tasks.cli.main
    from dcs_tasks import Checkpointer, CheckpointEngineClient
    from dcs_tasks.config import DCSConfig
    from workers.worker_app import make_worker_app

    make_worker_app(DCSConfig()).loader.import_default_modules()
    import workers.commit, workers.persist
    print("clean")
    for module in sys.argv[1:]:
        try:
            __import__(module)
        except ImportError as exc:
            print(module, "needs", exc)
    """
)


def test_dcs_imports_no_framework_and_each_integration_imports_its_own() -> None:
    env = {"PYTHONPATH": str(REPO), "DCS_REDIS_URL": "redis://127.0.0.1:1/0", "PATH": "/usr/bin:/bin"}
    integrations = ["dcs_tasks.integrations.lightning", "dcs_tasks.integrations.hf"]
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *integrations],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "clean", done.stdout
    # the probe does see a framework import: each integration module is refused its framework
    assert [line.split()[0] for line in lines[1:]] == integrations, done.stdout


def test_no_module_outside_the_integrations_imports_them() -> None:
    wrong = [
        f"{where(path, line)} imports {target}"
        for path in files_of("dcs_tasks", "workers", "coordinator")
        if "integrations" not in path.parts
        for line, target in imports_of(path)
        if target.startswith("dcs_tasks.integrations")
    ]
    assert wrong == [], "\n".join(wrong)
