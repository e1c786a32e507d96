"""verl from the package index for tests/integration/test_verl_backend.py and examples/verl_backend.py.

`make verl-lib` (`python -m tests.verl_lib.install`) puts verl and the few packages its `verl.checkpoint_engine`
imports into `.verl/` (git-ignored) with `pip install --no-deps --target`: the project's .venv is not changed, and
neither verl's full dependency list (ray[default], vllm or sglang extras, transformers < 5.11, CUDA wheels) nor
anything that would replace torch is pulled. `verl/__init__.py` imports `verl.protocol`, which imports `ray`, and
`verl.checkpoint_engine.base` imports ray's placement-group API, so ray itself (its core wheel, no extras) is among
them. Every package there is one the .venv lacks, so the order on the path does not matter.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

VERL_DIR = Path(__file__).resolve().parents[2] / ".verl"
VERL_VERSION = "0.9.1"


def installed() -> bool:
    return (VERL_DIR / ".installed").exists()


def on_path() -> None:
    """Make `import verl` work in this process (after the .venv's own packages)."""
    if str(VERL_DIR) not in sys.path:
        sys.path.append(str(VERL_DIR))


def pythonpath(env: dict[str, str]) -> dict[str, str]:
    """`env` with `.verl` appended to PYTHONPATH, for a child process that imports verl."""
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**env, "PYTHONPATH": os.pathsep.join([*parts, str(VERL_DIR)])}
