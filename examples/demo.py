"""The end-to-end demo, now a product command: this file only runs `dcs demo` with the same arguments.

`dcs demo` (dcs_tasks/local/demo.py, docs/local.md) starts a local stack, trains a tiny character-level
transformer with asynchronous checkpoints, kills the trainer with SIGKILL, resumes bit-exactly, pushes the
weights to two rollout receivers, and prints a summary table and the path of a PNG timeline.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    try:
        from dcs_tasks.cli.main import main
    except ImportError:  # a checkout without `pip install -e .`
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from dcs_tasks.cli.main import main
    sys.exit(main(["demo", *sys.argv[1:]]))
