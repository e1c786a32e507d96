"""Start harness processes (engines, reference trainers) forked from a process that already imported SGLang.

An engine's or trainer's start is almost all imports: torch, then SGLang (`sglang.srt.entrypoints.http_server`
pulls in transformers, fastapi, triton's CPU fallbacks...), about 15 s of CPU on a 2-core machine for every
`python -m tests.sglang_engine.serve` and 3-4 s for every `python -m tests.sglang_engine.trainer`, and each TP
rank's scheduler imports SGLang's scheduler modules again after its fork. A *zygote* per SGLang version pays
that once per pytest process: `python -m tests.sglang_engine.zygote --sglang-dir .sglang/V` imports what the
harness processes import (the serve module's own import path setup and stubs included), and then forks one
child per request. The child is what `python -m MODULE ARGS` would be: its own session (as
`start_new_session=True` gives), its own environment, working directory, argv and log file, SIGINT/SIGTERM as
a fresh interpreter has them, the module run as `__main__` by `runpy`; its exit status (a kill -9 shows as -9,
as with Popen) is reported back. The zygote is single-threaded when it forks and has made no process group,
socket or thread pool, so everything a child makes is its own. SGLang's code runs unchanged in the child: the
serve module re-reads the few settings SGLang takes from the environment at import (`serve.
_import_time_settings`).

Protocol (JSON lines; requests on the zygote's stdin, answers on its stdout):
    -> {"id": N, "module": M, "args": [...], "env": {...}, "cwd": D, "log": PATH, "err": PATH | null}
    <- {"ready": true, "seconds": S, "threads": T}     once, after the imports
    <- {"id": N, "pid": P}                              the child started
    <- {"exited": P, "code": C}                         a child ended (C as Popen.returncode)
The zygote exits (os._exit) when its stdin closes (the pytest process ended). `Zygote` is the client side.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
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


# --- the zygote process ----------------------------------------------------------------------------------


def _preload() -> None:
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # not in this version
        except Exception:  # the child that imports it reports it
            traceback.print_exc()


def _set_title(title: str) -> None:
    """What `ps` shows for the child (a fork keeps the zygote's command line otherwise)."""
    try:
        import setproctitle  # one of SGLang's dependencies (.sglang/deps)
    except ImportError:
        return
    setproctitle.setproctitle(title)


def _child(request: dict[str, Any], channel: tuple[int, int]) -> None:
    """In the forked child: become `python -m MODULE ARGS` and never return into the zygote's loop."""
    code = 1
    try:
        os.setsid()
        for fd in channel:
            os.close(fd)
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        signal.signal(signal.SIGINT, signal.default_int_handler)  # what a fresh interpreter has
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
        out = os.open(request["log"], flags, 0o644)
        err = os.open(request["err"], flags, 0o644) if request.get("err") else out
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        for fd in {out, err, null}:
            os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        sys.argv = [request["module"], *request["args"]]
        _set_title(f"python -m {request['module']} {' '.join(request['args'])} (forked from the SGLang zygote)")
        # The preloaded copy of the module (imported by the others) stays; its code runs again as __main__, as
        # `python -m` runs it. runpy warns about exactly that.
        warnings.filterwarnings(
            "ignore", message=".*found in sys.modules after import of package", category=RuntimeWarning
        )
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def serve_forever() -> None:
    """The zygote's loop (after `_preload`): fork a child per request, report each child's end."""
    started = time.monotonic()
    channel = (os.dup(0), os.dup(1))  # the protocol; fds 0/1 become /dev/null and stderr for everything else
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    _preload()
    proto_in, proto_out = channel

    def send(message: dict[str, Any]) -> None:
        data = (json.dumps(message) + "\n").encode()
        while data:
            data = data[os.write(proto_out, data) :]

    send({"ready": True, "seconds": round(time.monotonic() - started, 2), "threads": threading.active_count()})
    pending = b""
    while True:
        readable, _, _ = select.select([proto_in], [], [], 0.05)
        if readable:
            data = os.read(proto_in, 1 << 16)
            if not data:  # the pytest process is done or gone: no interpreter shutdown (seconds with SGLang)
                os._exit(0)
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _child(request, channel)
                send({"id": request["id"], "pid": pid})
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            send({"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def main() -> None:
    args = sys.argv[1:]
    if len(args) != 2 or args[0] != "--sglang-dir":
        raise SystemExit("usage: python -m tests.sglang_engine.zygote --sglang-dir .sglang/VERSION")
    from tests.sglang_engine.serve import sglang_path

    os.environ["SGLANG_HARNESS_PATH"] = os.pathsep.join(sglang_path(args[1]))
    os.environ.setdefault("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "false")  # as serve.main
    from tests.sglang_engine.serve import _setup_imports

    _setup_imports()
    serve_forever()
    # stdin closed: leave at once. An interpreter exit with SGLang loaded runs exit handlers the pytest process
    # would wait for at its own end (`Zygote.close`); the children are their owners' to kill.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --- the client side (the pytest process) --------------------------------------------------------------------


class ZygoteProcess:
    """A child of a zygote; the parts of `subprocess.Popen` the harness uses."""

    def __init__(self, zygote: Zygote, pid: int, args: list[str]) -> None:
        self.zygote, self.pid, self.args = zygote, pid, args

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def poll(self) -> int | None:
        return self.zygote.exit_code(self.pid)

    def wait(self, timeout: float | None = None) -> int:
        code = self.zygote.wait_exit(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass


IDLE_SECONDS = 300.0
"""A zygote with no live child and no request for this long is ended (it holds about 600 MB); the next engine
of its version starts a new one."""


class Retired(Exception):
    """The zygote was ended for idleness before this request reached it: ask a new one."""


class Zygote:
    """A zygote process for one SGLang version, started at once; `spawn` waits until its imports are done."""

    def __init__(self, sglang_dir: Path, env: dict[str, str]) -> None:
        self.log = Path(tempfile.gettempdir()) / f"sglang-zygote-{sglang_dir.name}-{os.getpid()}.log"
        self._lock = threading.Condition()
        self._ready: dict[str, Any] | None = None
        self._pids: dict[int, int] = {}
        self._exits: dict[int, int] = {}
        self._live: set[int] = set()
        self._used = time.monotonic()
        self._next_id = 0
        self._closed = False  # the zygote's stdout ended: it exited
        self.retired = False  # ended for idleness (or being ended)
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.sglang_engine.zygote", "--sglang-dir", str(sglang_dir)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
                cwd=REPO,
                start_new_session=True,  # a Ctrl-C to pytest does not reach it; it ends when its stdin closes
            )
        threading.Thread(target=self._read, name=f"sglang-zygote-{sglang_dir.name}", daemon=True).start()
        threading.Thread(
            target=self._retire_when_idle, name=f"sglang-zygote-idle-{sglang_dir.name}", daemon=True
        ).start()

    def _retire_when_idle(self) -> None:
        while True:
            time.sleep(min(10.0, IDLE_SECONDS))
            with self._lock:
                if self._closed or self.retired:
                    return
                if self._ready is not None and not self._live and time.monotonic() - self._used > IDLE_SECONDS:
                    self.retired = True
                    assert self.proc.stdin is not None
                    self.proc.stdin.close()  # it exits at once (and is reaped by close() or at exit)
                    return

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            message = json.loads(line)
            with self._lock:
                if "ready" in message:
                    self._ready = message
                elif "pid" in message:
                    self._pids[message["id"]] = message["pid"]
                    self._exits.pop(message["pid"], None)  # a pid the kernel reused
                    self._live.add(message["pid"])
                elif "exited" in message:
                    self._exits[message["exited"]] = message["code"]
                    self._live.discard(message["exited"])
                self._used = time.monotonic()
                self._lock.notify_all()
        with self._lock:
            self._closed = True
            self._lock.notify_all()

    def _failed(self, what: str) -> RuntimeError:
        try:
            tail = self.log.read_text(errors="replace")[-3000:]
        except FileNotFoundError:
            tail = ""
        return RuntimeError(f"SGLang zygote ({self.log}) {what}: {tail}")

    def spawn(
        self, module: str, args: list[str], env: dict[str, str], log: Path, timeout: float, err: Path | None = None
    ) -> ZygoteProcess:
        """`python -m module args` with `env`, stdout and stderr appended to `log` (stderr to `err` when given),
        forked once the zygote's imports are done (waits up to `timeout` for them)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            if self.retired:
                raise Retired()
            self._used = time.monotonic()
            while self._ready is None:
                if self._closed:
                    raise self._failed("exited")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._failed(f"not ready after {timeout}s")
                self._lock.wait(left)
            request_id, self._next_id = self._next_id, self._next_id + 1
            request = {"id": request_id, "module": module, "args": args, "env": env, "cwd": str(REPO)}
            request |= {"log": str(log), "err": str(err) if err else None}
            assert self.proc.stdin is not None
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
            while request_id not in self._pids:
                if self._closed:
                    raise self._failed("exited")
                self._lock.wait(1.0)
            return ZygoteProcess(self, self._pids.pop(request_id), [module, *args])

    def exit_code(self, pid: int) -> int | None:
        with self._lock:
            if pid in self._exits:
                return self._exits[pid]
            if self._closed:  # the zygote is gone: nobody reports this child's end any more
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    return -signal.SIGKILL
            return None

    def wait_exit(self, pid: int, timeout: float | None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while True:
                code = self.exit_code(pid)
                if code is not None:
                    return code
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._lock.wait(0.2 if left is None else min(left, 0.2))

    def close(self) -> None:
        """End the zygote (its children live on: their owners kill them) and remove its log."""
        with self._lock:
            self.retired = True
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.close()
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)
        self.log.unlink(missing_ok=True)


_zygotes: dict[Path, Zygote] = {}
_zygotes_lock = threading.Lock()


def zygote(sglang_dir: Path, env: dict[str, str]) -> Zygote:
    """This process's zygote for `sglang_dir` (started on first use, with `env`; closed when the process exits
    or after IDLE_SECONDS without a child)."""
    with _zygotes_lock:
        found = _zygotes.get(sglang_dir)
        if found is None or found._closed or found.retired:
            if found is not None:
                found.close()  # reaped
            found = _zygotes[sglang_dir] = Zygote(sglang_dir, env)
        return found


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
    """`Zygote.spawn` on this process's zygote for `sglang_dir` (a new one when it was just retired)."""
    while True:
        try:
            return zygote(sglang_dir, zygote_env).spawn(module, args, env, log, timeout, err)
        except Retired:
            continue


@atexit.register
def _close_all() -> None:
    for found in list(_zygotes.values()):
        found.close()


if __name__ == "__main__":
    main()
