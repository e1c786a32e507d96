"""`python -m MODULE ARGS` for test processes, without paying torch's import in every one of them.

A rank of a multi-process torch.distributed test is a fresh process that imports torch, torch.distributed and
DCS before it does anything: 3-5 s of CPU each on a 2-core machine, times 17 ranks in one DTensor test. Here
they are forked instead from a multiprocessing *forkserver* that imported those modules once per pytest process
(the forkserver is single-threaded when it forks, and has initialised no process group, no CUDA and no thread
pool): each child gets its own environment, working directory, argv and log file, runs the module as
`__main__` with `runpy`, and exits with the module's exit status (a kill -9 shows as -9, as with Popen). The
child is a new process, so every torch.distributed group, socket and file it makes is its own.

Use it for processes the test only starts, waits for and kills. A process that re-execs itself from its command
line (`dcs worker` after a crash) runs `sys.orig_argv`, which the child sets to `python -m MODULE ARGS`: the
re-exec is a fresh interpreter, as after a `subprocess.Popen`. The child runs the interpreter's exit handlers
(atexit) when the module returns or exits, as a fresh interpreter would. A process of a simulated host is forked
from here too and joins the host's namespaces itself (`tests/multihost/inhost.py`, `SimulatedHost.spawn_python`).
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from multiprocessing.context import ForkServerContext
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch._dynamo",  # DTensor.from_local and distribute_tensor import it on first use: ~3.4 s of a rank's 3.5 s
    "dcs_tasks.checkpoint.checkpointer",
    "dcs_tasks.client.engine",
    "tests.checkpoint_support",
    # what `dcs worker` and `dcs coordinator` import beyond that (about 0.8 s of CPU per start), their own modules
    # excepted: workers.signals connects Celery signals at import, which no other process forked from here wants
    "celery.apps.worker",
    "celery.worker.consumer",
    "celery.concurrency.prefork",
    "kombu.transport.redis",
    "fastapi",
    "uvicorn",
]

_context: ForkServerContext | None = None


def _forkserver() -> ForkServerContext:
    global _context
    if _context is None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)
        _context = context
    return _context


def become_fresh_process(
    env: dict[str, str],
    cwd: str,
    *,
    stdout: str | int,
    stderr: str | None = None,
    stdin: int | None = None,
    then: Callable[[], None] | None = None,
) -> None:
    """In a child just forked from the forkserver: make it what `Popen(..., start_new_session=True)` of a fresh
    interpreter would have started. Its own session and process group; SIGINT and SIGTERM as a fresh interpreter
    has them; stdin /dev/null (or the fd `stdin`), stdout appended to the file `stdout` (or the fd), stderr
    appended to the file `stderr` (None: the stdout file; a stdout fd needs a stderr file); then `then()` (e.g.
    entering a simulated host's namespaces), the working directory and the environment. The caller closes an fd
    it passed once this returns."""
    os.setsid()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
    opened: set[int] = set()
    if isinstance(stdout, str):
        out = os.open(stdout, flags, 0o644)
        opened.add(out)
    else:
        out = stdout
    if stderr is not None:
        errors = os.open(stderr, flags, 0o644)
        opened.add(errors)
    elif isinstance(stdout, str):
        errors = out
    else:
        raise ValueError("stderr needs a file when stdout is a descriptor")
    if stdin is None:
        stdin = os.open(os.devnull, os.O_RDONLY)
        opened.add(stdin)
    os.dup2(stdin, 0)
    os.dup2(out, 1)
    os.dup2(errors, 2)
    for fd in opened:
        os.close(fd)
    if then is not None:
        then()
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # chosen again from this environment's TMPDIR, as a fresh interpreter would (the
    # forkserver's imports may have fixed it from the pytest process's)
    from workers.prometheus import follow_multiprocess_env

    follow_multiprocess_env()  # prometheus_client, preloaded, picks its value store for this environment


def _run_module(module: str, args: list[str], env: dict[str, str], cwd: str, log: str, err: str | None) -> None:
    """In the forked child: the process `python -m module args` would be, writing to `log` (and its stderr to
    `err` when given)."""
    become_fresh_process(env, cwd, stdout=log, stderr=err)
    sys.argv = [module, *args]
    sys.orig_argv = [sys.executable, "-m", module, *args]  # what a process re-exec'ing itself runs (dcs worker)
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        atexit._run_exitfuncs()  # as the interpreter's exit would (multiprocessing ends the child with os._exit)


class PreloadedProcess:
    """A started `python -m MODULE ARGS`; the parts of `subprocess.Popen` the tests use."""

    def __init__(
        self, module: str, args: list[str], log: Path, env: dict[str, str] | None, cwd: Path, err: Path | None = None
    ) -> None:
        self.log = log
        self.args = [module, *args]
        environment = dict(os.environ if env is None else env)
        errors = str(err) if err is not None else None
        self._process = _forkserver().Process(
            target=_run_module, args=(module, args, environment, str(cwd), str(log), errors), daemon=False
        )
        self._process.start()
        assert self._process.pid is not None
        self.pid: int = self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self._process.exitcode

    def send_signal(self, signum: int) -> None:
        if self._process.exitcode is None and self.pid is not None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        """kill -9 of its process group (whatever it started too); nothing when it has exited."""
        if self._process.exitcode is None and self.pid is not None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._process.join(10)

    def output(self, tail: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-tail:]
        except FileNotFoundError:
            return ""


def python_module(
    module: str, *args: str, log: Path, env: dict[str, str] | None = None, cwd: Path = REPO
) -> PreloadedProcess:
    """Start `python -m module args` forked from the preloaded forkserver; stdout and stderr go to `log`."""
    return PreloadedProcess(module, list(args), log, env, cwd)


def run_module(
    module: str, *args: str, workdir: Path, env: dict[str, str] | None = None, cwd: Path = REPO, timeout: float
) -> subprocess.CompletedProcess[str]:
    """`subprocess.run([python, "-m", module, *args], capture_output=True, text=True)`, forked from the preloaded
    forkserver: stdout and stderr are collected through files under `workdir`."""
    workdir.mkdir(parents=True, exist_ok=True)
    handle, out_name = tempfile.mkstemp(prefix="out-", dir=workdir)
    os.close(handle)
    out, err = Path(out_name), Path(out_name + ".err")
    proc = PreloadedProcess(module, list(args), out, env, cwd, err)
    try:
        code = proc.wait(timeout)
    finally:
        proc.kill()
    stderr = err.read_text(errors="replace") if err.exists() else ""
    return subprocess.CompletedProcess([module, *args], code, out.read_text(errors="replace"), stderr)
