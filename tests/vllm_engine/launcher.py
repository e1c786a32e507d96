"""Forks harness servers (`serve.py`) from one process that imported vLLM once (`harness.VLLMEngine` uses it).

    python -m tests.vllm_engine.launcher --vllm-dir .vllm/0.33.0 --fd N

Importing vLLM, torch and the HTTP stack costs 10-30 s of CPU per process on a 2-core machine; a test module
that starts four engines paid it four times (and once more per TP worker). This process pays it once: it puts
the vLLM environment on its path exactly as `serve.py` does, imports the modules `serve.py`, `client.py` and
`worker.py` import, then serves requests on the socket inherited as fd N (a `multiprocessing.connection`):

    ("start", argv, env, cwd, log) -> pid   fork a child that runs `serve.main(argv)` in its own session, with
                                            `env` as its environment, `cwd` as its directory, stdout and stderr
                                            appended to `log` (what `python -m tests.vllm_engine.serve ARGV`
                                            started with `start_new_session=True` would be)
    ("status", pid) -> int | None           the child's exit status (-N: killed by signal N), None while it runs
    ("kill", pid) -> None                   kill -9 of the child's process group, unless it was already reaped

It is started with the servers' environment less `PER_SERVER_SETTINGS` (one launcher per such environment: vLLM
reads variables at import time), runs no torch op and starts no thread before it forks, and exits when the
socket closes (the test process ended). It also fills the per-process cache of the system report dev mode's
`/server_info` answers (vLLM's collect_env, ~3 s of subprocesses), so each forked server answers its first
`/server_info` as fast as its later ones. Its children are its own: it reaps them, so
a pid it reports exited is never signalled again.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import os
import signal
import sys
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from tests.helpers.zygote import exit_status
from tests.vllm_engine import serve

PRELOAD = (
    "torch",
    "torch.distributed",
    "uvicorn",
    "fastapi.responses",
    "starlette.middleware.cors",
    "vllm.config",
    "vllm.config.weight_transfer",
    "vllm.plugins",
    "vllm.plugins.endpoint_plugins",
    "vllm.plugins.io_processors",
    "vllm.utils.argparse_utils",
    "vllm.utils.system_utils",
    "vllm.lora.resolver",
    "vllm.renderers.online_renderer",
    "vllm.entrypoints.serve",
    "vllm.entrypoints.serve.dev.server_info.api_router",
    "vllm.entrypoints.serve.engine.serving",
    "vllm.entrypoints.serve.instrumentator.basic",
    "vllm.entrypoints.serve.instrumentator.health",
    "vllm.entrypoints.serve.middleware.register",
    "vllm.entrypoints.serve.sagemaker.api_router",
    "vllm.entrypoints.serve.tokenize.serving",
    "vllm.entrypoints.serve.utils.api_utils",
    "vllm.entrypoints.serve.lora.protocol",
    "vllm.entrypoints.common.startup",
    "vllm.entrypoints.generate.factories",
    "vllm.entrypoints.pooling.factories",
    "vllm.entrypoints.launchers.api_server.routers",
    "vllm.entrypoints.launchers.utils.server_utils",
    "vllm.entrypoints.launchers.utils.ssl",
    "vllm.entrypoints.anthropic.protocol",
    "vllm.entrypoints.openai.completion.protocol",
    "vllm.entrypoints.openai.models.serving",
    "vllm.entrypoints.openai.responses.harmony",
    "vllm.entrypoints.openai.responses.utils",
    "vllm.entrypoints.scale_out.token_in_token_out.protocol",
    "vllm.entrypoints.speech_to_text.transcription.protocol",
    "vllm.entrypoints.speech_to_text.translation.protocol",
    "vllm.v1.engine.async_llm",
    "vllm.v1.engine.exceptions",
    "vllm.v1.worker.gpu_worker",
    "vllm.distributed.weight_transfer.factory",
    "vllm.distributed.weight_transfer.nccl_engine",
    "vllm.distributed.weight_transfer.packed_tensor",
    "vllm.model_executor.model_loader.reload",
    "vllm.model_executor.model_loader.weight_utils",
    "tests.vllm_engine.client",
    "tests.vllm_engine.worker",
    "tests.vllm_engine.tiny_model",
)
"""vLLM's and the harness's modules a server and its workers import (not DCS's plugin: `load_general_plugins`
finds and loads it in each server, as `vllm serve` does), but none of `NOT_PRELOADED`."""

PER_SERVER_SETTINGS = ("VLLM_SERVER_DEV_MODE",)
"""Variables that may differ between the servers one launcher forks: the launcher runs without them, and vLLM
reads them only at run time, or while importing `NOT_PRELOADED`, which each server imports itself."""

NOT_PRELOADED = ("vllm.entrypoints.common.cli_args",)
"""Modules that read a `PER_SERVER_SETTINGS` variable when imported (cli_args: `log_error_stack` defaults to
VLLM_SERVER_DEV_MODE), and with them what imports them (vLLM's `build_app`): ~0.1 s of imports per server."""


def _run_child(fd: int, argv: list[str], env: dict[str, str], cwd: str, log: str) -> None:
    """In the forked child: become `python -m tests.vllm_engine.serve ARGV`; never returns."""
    code = 1
    try:
        os.close(fd)
        os.setsid()
        out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        os.close(null)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        sys.argv = [serve.__file__, *argv]
        serve.main(argv)
        code = 0
    except SystemExit as exc:
        code = exit_status(exc)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()  # what the interpreter runs at a normal exit
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve_requests(conn: Connection, fd: int) -> None:
    exited: dict[int, int] = {}
    children: set[int] = set()
    while True:
        while children:  # reap whatever has ended
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            children.discard(pid)
            exited[pid] = os.waitstatus_to_exitcode(status)
        if not conn.poll(0.1):
            continue
        try:
            request: tuple[Any, ...] = conn.recv()
        except EOFError:
            return
        kind = request[0]
        if kind == "start":
            _, argv, env, cwd, log = request
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _run_child(fd, argv, env, cwd, log)
            children.add(pid)
            conn.send(pid)
        elif kind == "status":
            conn.send(exited.get(request[1]))
        elif kind == "kill":
            if request[1] in children:
                try:
                    os.killpg(request[1], signal.SIGKILL)
                except ProcessLookupError:
                    pass
            conn.send(None)
        else:
            conn.send(ValueError(f"unknown request {kind!r}"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-dir", required=True)
    parser.add_argument("--fd", type=int, required=True)
    ours = parser.parse_args()
    serve.use_vllm_dir(Path(ours.vllm_dir))
    assert not any(os.environ.get(name) for name in PER_SERVER_SETTINGS), "started with a per-server setting"
    for module in PRELOAD:
        importlib.import_module(module)
    early = [name for name in NOT_PRELOADED if name in sys.modules]
    if early:  # another vLLM version may import it from a module above: it would carry the launcher's settings
        raise RuntimeError(f"preloading imported {early}, which read per-server settings at import")
    # dev mode's /server_info answers vLLM's collect_env report, cached per process after its first call (~3 s:
    # it runs pip, gcc, lscpu, ...); made here once, the report every forked server would make
    from vllm.entrypoints.serve.dev.server_info.api_router import _get_system_env_info_cached

    _get_system_env_info_cached()
    serve_requests(Connection(ours.fd), ours.fd)
    # the pytest process closed its end: leave now. An interpreter exit with vLLM loaded ran its exit handlers
    # for over 10 s, which the pytest process waits for at its own exit (vllm_engine.harness._close_launchers),
    # and xdist's controller waits up to 10 s for that before ending the run. The servers forked from here are
    # the tests' to kill, and have been.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
