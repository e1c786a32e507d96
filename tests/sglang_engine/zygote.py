"""Start harness processes (engines, reference trainers) forked from a process that already imported SGLang.

An engine's or trainer's start is almost all imports: torch, then SGLang (`sglang.srt.entrypoints.http_server`
pulls in transformers, fastapi, triton's CPU fallbacks...), about 15 s of CPU on a 2-core machine for every
`python -m tests.sglang_engine.serve` and 3-4 s for every `python -m tests.sglang_engine.trainer`, and each TP
rank's scheduler imports SGLang's scheduler modules again after its fork. A *zygote* per SGLang version pays
that once per pytest process: `python -m tests.sglang_engine.zygote --sglang-dir .sglang/V` imports what the
harness processes import (the serve module's own import path setup and stubs included), and then forks one
child per request (tests/helpers/zygote.py: what a child is, the protocol, the client side). SGLang's code runs
unchanged in the child: the serve module re-reads the few settings SGLang takes from the environment at import
(`serve._import_time_settings`). The children live on when the zygote ends: their owners kill them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tests.helpers import zygote as zygotes
from tests.helpers.zygote import Zygote, ZygoteProcess

__all__ = ["PRELOAD", "Zygote", "ZygoteProcess", "spawn", "zygote"]

PRELOAD = (
    "torch",
    "torch.distributed",
    "httpx",
    "safetensors.torch",
    "tests.sglang_engine.serve",
    "tests.sglang_engine.scheduler",
    "tests.sglang_engine.trainer",
    "tests.sglang_engine.tiny_model",
    "sglang.srt.entrypoints.http_server",
    "sglang.srt.entrypoints.engine",
    "sglang.srt.server_args",
    "sglang.srt.managers.tokenizer_manager",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.tp_worker",
    "sglang.srt.managers.io_struct",
    "sglang.srt.managers.utils",
    "sglang.srt.managers.scheduler_components.weight_updater",
    "sglang.srt.managers.scheduler_components.ipc_channels",
    "sglang.srt.model_executor.model_runner_components.weight_updater",
    "sglang.srt.model_executor.model_runner_components.weight_exporter",
    "sglang.srt.model_loader.weight_utils",
    "sglang.srt.runtime_context",
    "sglang.srt.utils",
    "sglang.srt.weight_sync.tensor_bucket",
    "transformers.models.llama.configuration_llama",
    "uvicorn",
    "setproctitle",
)
"""What the harness processes import (modules a version lacks are passed over): serve's server process, its
scheduler processes, the reference trainer."""


def main() -> None:
    args = sys.argv[1:]
    if len(args) != 2 or args[0] != "--sglang-dir":
        raise SystemExit("usage: python -m tests.sglang_engine.zygote --sglang-dir .sglang/VERSION")
    from tests.sglang_engine.serve import sglang_path

    os.environ["SGLANG_HARNESS_PATH"] = os.pathsep.join(sglang_path(args[1]))
    os.environ.setdefault("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "false")  # as serve.main
    from tests.sglang_engine.serve import _setup_imports

    _setup_imports()
    zygotes.serve_forever(PRELOAD)  # leaves with os._exit once the pytest process closes its stdin


def _name(sglang_dir: Path) -> str:
    return f"sglang-{sglang_dir.name}"


def _argv(sglang_dir: Path) -> list[str]:
    return [sys.executable, "-m", "tests.sglang_engine.zygote", "--sglang-dir", str(sglang_dir)]


def zygote(sglang_dir: Path, env: dict[str, str]) -> Zygote:
    """This process's zygote for `sglang_dir` (started on first use, with `env`; closed when the process exits
    or after `tests.helpers.zygote.IDLE_SECONDS` without a child)."""
    return zygotes.zygote(_name(sglang_dir), _argv(sglang_dir), env)


def spawn(
    sglang_dir: Path,
    zygote_env: dict[str, str],
    module: str,
    args: list[str],
    env: dict[str, str],
    log: Path,
    timeout: float,
    err: Path | None = None,
) -> ZygoteProcess:
    """`python -m module args` with `env`, stdout and stderr appended to `log` (stderr to `err` when given),
    forked from this process's zygote for `sglang_dir` once its imports are done (waits up to `timeout`)."""
    title = f"python -m {module} {' '.join(args)} (forked from the SGLang zygote)"
    return zygotes.spawn(
        _name(sglang_dir),
        _argv(sglang_dir),
        zygote_env,
        module,
        args,
        env=env,
        log=log,
        timeout=timeout,
        err=err,
        title=title,
    )


if __name__ == "__main__":
    main()
