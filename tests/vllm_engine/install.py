"""Install the vLLM versions the harness serves, without their GPU dependencies (`make vllm-engines`).

    python -m tests.vllm_engine.install [--root .vllm] [VERSION ...]

Layout (git-ignored): ROOT/<version>/ holds `vllm==<version>` (the wheel's compiled CUDA extensions are there but
never load: `vllm._C` fails to import on a CPU-only torch and vLLM carries on without it), ROOT/deps/ the pure-Python
or CPU packages its HTTP app, RL router, config, worker and weight-transfer modules import, ROOT/plugins/ DCS's vLLM
plugin (`pip install plugins/vllm-dcs`, as a user installs it next to vLLM: vLLM finds it through its
`vllm.general_plugins` entry point; the harness registers no engine itself). Everything is
`pip install --no-deps --target`, so the project's .venv (torch, fastapi, transformers, ...) is never changed and
nothing pulls a CUDA wheel. A finished directory carries a stamp naming what was installed (for the plugin: a
sha256 of its files); an unchanged one is skipped.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import time
from pathlib import Path

VERSIONS = ("0.33.0",)
"""0.33.0: the newest vLLM on the package index when this was written; the RL API DCS drives (docs/weight_sync.md)."""

NEEDED = (
    "apache-tvm-ffi==0.1.11", "cachetools==8.0.2", "cbor2==6.3.0", "cloudpickle==3.1.3", "einops==0.8.2",
    "llguidance>=1.7.0,<1.8.0", "model-hosting-container-standards==0.1.16", "msgspec==0.23.0", "openai==3.57.0",
    "openai-harmony==0.0.8", "orjson==3.13.0", "partial-json-parser==0.2.1.1.post7",
    "prometheus-fastapi-instrumentator==8.1.0", "psutil==7.2.2", "py-cpuinfo==9.0.0", "pybase64==1.5.1",
    "pyzmq==27.3.0", "sniffio==1.3.1", "uvloop==0.23.0", "watchfiles==1.3.0", "xgrammar==0.2.8",
)  # fmt: skip
"""What vLLM's imports need beyond the project's .venv (found by importing the modules the harness runs)."""


PLUGIN = Path(__file__).resolve().parents[2] / "plugins" / "vllm-dcs"
"""DCS's vLLM plugin (its own distribution: backend "dcs" through a `vllm.general_plugins` entry point)."""


def pip_target(target: Path, requirements: list[str], *options: str) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--upgrade", "--target", str(target)]
    subprocess.run([*cmd, *options, *requirements], check=True)


def _install(target: Path, requirements: list[str], content: str | None = None, *options: str) -> None:
    stamp = target / ".installed"
    content = content or "\n".join(requirements) + "\n"
    if stamp.exists() and stamp.read_text() == content:
        return
    pip_target(target, requirements, *options)
    stamp.write_text(content)


def plugin_stamp(source: Path = PLUGIN) -> str:
    """What the plugin's stamp says: a sha256 of its files, so an edited plugin is installed again."""
    digest = hashlib.sha256()
    for path in sorted([source / "pyproject.toml", *source.glob("vllm_dcs/*.py")]):
        digest.update(str(path.relative_to(source)).encode() + b"\0" + path.read_bytes())
    return f"{source.name} {digest.hexdigest()}\n"


def install_plugin(target: Path, source: Path = PLUGIN) -> None:
    """`pip install plugins/vllm-dcs` into `target` (no build isolation: the project's setuptools builds it)."""
    _install(target, [str(source)], plugin_stamp(source), "--no-build-isolation")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default=str(Path(__file__).resolve().parents[2] / ".vllm"))
    parser.add_argument("versions", nargs="*", default=list(VERSIONS))
    args = parser.parse_args()
    root = Path(args.root)
    started = time.perf_counter()
    for version in args.versions:
        _install(root / version, [f"vllm=={version}"])
    _install(root / "deps", list(NEEDED))
    install_plugin(root / "plugins")
    print(f"vLLM {', '.join(args.versions)} ready under {root} ({time.perf_counter() - started:.0f}s)")


if __name__ == "__main__":
    main()
