"""Install the SGLang versions the harness serves, without their GPU dependencies (`make sglang-engines`).

    python -m tests.sglang_engine.install [--root .sglang] [VERSION ...]

Layout (git-ignored): ROOT/<version>/ holds `sglang==<version>` and the dependencies that version pins
exactly (transformers, tokenizers, openai, ...), ROOT/deps/ the other pure-Python or CPU packages its
import chain needs. Everything is `pip install --no-deps --target`, so the project's .venv (torch, fastapi,
pydantic, ...) is never changed and nothing pulls a CUDA wheel. A finished directory carries a stamp naming
what was installed; an unchanged one is skipped.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

VERSIONS = ("0.5.20", "0.5.23")
"""0.5.23: newest, weight-update sessions (/begin_weight_update, since 0.5.21); 0.5.20: newest without."""

NEEDED = (
    "aiohappyeyeballs==2.7.1", "aiohttp==3.14.5", "aiosignal==1.4.0", "apache-tvm-ffi==0.1.11",
    "attrs==26.1.0", "cffi==2.1.1", "compressed-tensors==0.20.1", "dill==0.4.1", "distro==1.9.0", "einops==0.8.2",
    "frozenlist==1.8.0", "gguf==0.19.0", "huggingface-hub==1.33.0", "ipython==9.18.1", "jsonschema==4.26.0",
    "jiter==0.19.0", "jsonschema-specifications==2025.9.1", "loguru==0.7.3", "msgspec==0.23.0", "multidict==7.2.1",
    "openai==2.8.0", "orjson==3.13.0", "partial-json-parser==0.2.1.1.post7", "pillow==13.0.0",
    "propcache==0.5.4", "psutil==7.2.2", "pybase64==1.5.1", "pycparser==3.12", "python-multipart==0.0.34",
    "pyzmq==27.3.0", "referencing==0.37.0", "regex==2026.11.19", "rpds-py==2026.9.1", "sentencepiece==0.2.3",
    "setproctitle==1.3.8", "sniffio==1.3.1", "soundfile==0.14.0", "tqdm==4.70.1", "traitlets==5.16.1",
    "triton==3.9.0", "uvloop==0.23.0", "xgrammar==0.2.9", "yarl==1.25.1", "tokenizers==0.23.2",
    "transformers==5.19.0",
)  # fmt: skip
"""What `import sglang.srt.entrypoints.http_server` and the scheduler's weight-update modules need beyond
the project's .venv, at the versions tested; a version SGLang pins exactly (`==` in its METADATA) wins."""


def _name(requirement: str) -> str:
    return re.split(r"[=<>!~; \[]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def exact_pins(wheel_dir: Path) -> dict[str, str]:
    """`name -> name==X` for SGLang's unconditional exact pins, from its installed METADATA."""
    metadata = next(wheel_dir.glob("sglang-*.dist-info/METADATA")).read_text()
    pins = {}
    for line in metadata.splitlines():
        if line.startswith("Requires-Dist:") and "==" in line and ";" not in line:
            requirement = line.split(":", 1)[1].strip()
            pins[_name(requirement)] = requirement.replace(" ", "")
    return pins


def pip_target(target: Path, requirements: list[str]) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--upgrade", "--target", str(target)]
    subprocess.run([*cmd, *requirements], check=True)


def _stamped(directory: Path, content: str) -> bool:
    stamp = directory / ".installed"
    return stamp.exists() and stamp.read_text() == content


def install_sglang(root: Path, version: str) -> None:
    target = root / version
    if not list(target.glob(f"sglang-{version}.dist-info/METADATA")):
        pip_target(target, [f"sglang=={version}"])


def install_pinned(root: Path, version: str, pinned_anywhere: set[str]) -> None:
    """Into ROOT/<version>: every needed package some harness version pins, at this version's pin if any."""
    target = root / version
    pins = exact_pins(target)
    own = sorted(pins.get(_name(r), r) for r in NEEDED if _name(r) in pinned_anywhere)
    content = "\n".join([f"sglang=={version}", *own]) + "\n"
    if _stamped(target, content):
        return
    pip_target(target, own)
    (target / ".installed").write_text(content)


def install_shared(root: Path, pinned_anywhere: set[str]) -> None:
    """Into ROOT/deps: the needed packages no harness version pins."""
    shared = [r for r in NEEDED if _name(r) not in pinned_anywhere]
    content = "\n".join(shared) + "\n"
    target = root / "deps"
    if _stamped(target, content):
        return
    pip_target(target, shared)
    (target / ".installed").write_text(content)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default=str(Path(__file__).resolve().parents[2] / ".sglang"))
    parser.add_argument("versions", nargs="*", default=list(VERSIONS))
    args = parser.parse_args()
    root = Path(args.root)
    started = time.perf_counter()
    for version in args.versions:
        install_sglang(root, version)
    pinned_anywhere = set().union(*(exact_pins(root / v) for v in args.versions)) & {_name(r) for r in NEEDED}
    for version in args.versions:
        install_pinned(root, version, pinned_anywhere)
    install_shared(root, pinned_anywhere)
    print(f"SGLang {', '.join(args.versions)} ready under {root} ({time.perf_counter() - started:.0f}s)")


if __name__ == "__main__":
    main()
