"""Install verl and what its `verl.checkpoint_engine` imports into `.verl/`, without verl's dependencies
(`make verl-lib`; tests/verl_lib/__init__.py says why).

    python -m tests.verl_lib.install [--target .verl]

`NEEDED` was found by importing `verl.checkpoint_engine` with the .venv's packages plus `.verl/` until it imported;
the .venv already has torch, numpy, packaging, pydantic, pyyaml and attrs. A finished directory carries a stamp
naming what was installed; an unchanged one is skipped.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from tests.verl_lib import VERL_DIR, VERL_VERSION

NEEDED = (
    f"verl=={VERL_VERSION}", "ray==2.60.0", "tensordict==0.10.0", "pyvers==0.2.3", "cloudpickle==3.1.3",
    "codetiming==1.4.0", "omegaconf==2.4.0", "orjson==3.13.0", "msgpack==1.2.4", "protobuf==7.36.2",
    "jsonschema==4.26.0", "jsonschema-specifications==2025.9.1", "referencing==0.37.0", "rpds-py==2026.9.1",
)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=str(VERL_DIR))
    target = Path(parser.parse_args().target)
    stamp, content = target / ".installed", "\n".join(NEEDED) + "\n"
    if stamp.exists() and stamp.read_text() == content:
        print(f"verl {VERL_VERSION} already under {target}")
        return
    started = time.perf_counter()
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--upgrade", "--target", str(target)]
    subprocess.run([*cmd, *NEEDED], check=True)
    stamp.write_text(content)
    print(f"verl {VERL_VERSION} ready under {target} ({time.perf_counter() - started:.0f}s)")


if __name__ == "__main__":
    main()
