"""Run a real SGLang HTTP server on CPU (test harness; never product code).

    python -m tests.sglang_engine.serve --sglang-dir .sglang/0.5.23 --port 30000 --tp 2 --api-key KEY

SGLang's own `launch_server` runs: its ServerArgs (parsed by `prepare_server_args` from SGLang CLI flags),
its FastAPI app and API-key middleware (sglang/srt/entrypoints/http_server.py), its TokenizerManager and
the ZMQ channels to one scheduler process per TP rank. Only the scheduler processes' insides differ: the
harness scheduler (tests.sglang_engine.scheduler) runs SGLang's weight-update stack around a tiny CPU
model instead of the GPU model and batcher. Flags after `--` go to SGLang unchanged.

The SGLang package is imported from `--sglang-dir` (a `pip install --no-deps --target` tree, see the
Makefile's `sglang-engines`), with `.sglang/deps` (its pure-Python and CPU dependencies) after it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STUBBED = ("torchvision",)
"""Imported by SGLang's multimodal configs at import time; PyPI's wheels need a CUDA build of torch."""


def sglang_path(sglang_dir: str | os.PathLike[str]) -> list[str]:
    """The sys.path entries that make `import sglang` load the version in `sglang_dir`."""
    root = Path(sglang_dir).resolve()
    return [str(root), str(root.parent / "deps")]


def _setup_imports() -> None:
    """Before anything imports sglang (also in spawned scheduler processes, which re-import this module)."""
    entries = os.environ.get("SGLANG_HARNESS_PATH", "")
    for entry in reversed([e for e in entries.split(os.pathsep) if e]):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    from tests.sglang_engine.stubs import install_stubs

    install_stubs(STUBBED)


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sglang-dir", required=True, help="e.g. .sglang/0.5.23")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--tp", type=int, default=1, help="TP ranks (scheduler processes)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--work-dir", default=None, help="where the model's config.json goes (default: a temp dir)")
    cut = argv.index("--") if "--" in argv else len(argv)
    return parser.parse_args(argv[:cut]), argv[cut + 1 :]


def model_dir(work_dir: str | None) -> str:
    """A checkpoint directory holding only config.json (SGLang's ModelConfig reads it; no weights)."""
    from tests.sglang_engine.tiny_model import hf_config

    path = Path(tempfile.mkdtemp(prefix="sglang-tiny-", dir=work_dir))
    (path / "config.json").write_text(json.dumps(hf_config()))
    return str(path)


def sglang_argv(args: argparse.Namespace, extra: list[str]) -> list[str]:
    argv = [
        "--model-path", model_dir(args.work_dir),
        "--device", "cpu",
        "--host", args.host,
        "--port", str(args.port),
        "--tp-size", str(args.tp),
        "--skip-tokenizer-init",
        "--skip-server-warmup",
        "--disable-cuda-graph",
    ]  # fmt: skip
    if args.api_key:
        argv += ["--api-key", args.api_key]
    return argv + extra


def main(argv: list[str] | None = None) -> None:
    args, extra = parse(sys.argv[1:] if argv is None else argv)
    os.environ["SGLANG_HARNESS_PATH"] = os.pathsep.join(sglang_path(args.sglang_dir))
    # SGLang's knob: /health answers 200 without running a generation (the harness cannot generate).
    os.environ.setdefault("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "false")
    # SGLang's crash diagnostics (py-spy of the scheduler processes, a CUDA coredump) have nothing to dump on a
    # CPU-only harness; on, they would first sleep 5 s "to let GPU activity settle" before the server dies.
    os.environ.setdefault("SGLANG_PYSPY_DUMP_BEFORE_CRASH", "false")
    os.environ.setdefault("SGLANG_CUDA_COREDUMP_BEFORE_CRASH", "false")
    _setup_imports()
    from sglang.srt.entrypoints.http_server import launch_server
    from sglang.srt.server_args import prepare_server_args

    from tests.sglang_engine.scheduler import run_detokenizer, run_scheduler

    _import_time_settings()
    server_args = prepare_server_args(sglang_argv(args, extra))
    _fork_subprocesses()
    launch_server(server_args, run_scheduler_process_func=run_scheduler, run_detokenizer_process_func=run_detokenizer)


IMPORT_TIME_SETTINGS = {
    "sglang.srt.entrypoints.http_server": {
        "HEALTH_CHECK_TIMEOUT": "SGLANG_HEALTH_CHECK_TIMEOUT",
        "WAIT_WEIGHTS_READY_TIMEOUT": "SGLANG_WAIT_WEIGHTS_READY_TIMEOUT",
    },
}
"""Module constants SGLang sets from the environment when the module is imported (`int(os.getenv(...))`)."""


def _import_time_settings() -> None:
    """A server forked from the harness's zygote (tests/sglang_engine/zygote.py) has SGLang's modules imported
    under the zygote's environment (no SGLANG_ variables): the constants SGLang reads at import are set again
    from this process's environment where it names them, as a fresh import would have."""
    for module_name, constants in IMPORT_TIME_SETTINGS.items():
        module = sys.modules.get(module_name)
        for constant, variable in constants.items():
            if module is not None and hasattr(module, constant) and variable in os.environ:
                setattr(module, constant, int(os.environ[variable]))


def _fork_subprocesses() -> None:
    """Start SGLang's scheduler and detokenizer processes by fork instead of spawn: they inherit this process's
    imports (SGLang and torch, ~15 s per process on a 2-core machine) instead of repeating them. SGLang asks
    for spawn because CUDA cannot be forked; these processes never touch CUDA (CPU-only harness). They still
    run SGLang's own process entry points with SGLang's own arguments and ZMQ sockets, created after the fork."""
    import multiprocessing

    multiprocessing.set_start_method("fork", force=True)
    multiprocessing.set_start_method = lambda *_, **__: None  # type: ignore[assignment]  # SGLang forces spawn


_setup_imports()

if __name__ == "__main__":
    main()
