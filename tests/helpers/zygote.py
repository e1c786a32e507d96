"""Processes forked from a *zygote*: a process that imported what they import, once per pytest process, and then
forks one child per request. The SGLang engines (tests/sglang_engine/zygote.py) and the Swift servers of the S3
tests (tests/helpers/swift_serve.py) start this way: their start is almost all imports.

A child is what `python -m MODULE ARGS` would be: its own session (as `start_new_session=True` gives), its own
environment, working directory, argv and log file, SIGINT/SIGTERM as a fresh interpreter has them, the module run
as `__main__` by `runpy`; its exit status (a kill -9 shows as -9, as with Popen) is reported back. The zygote is
single-threaded when it forks and has made no process group, socket or thread pool, so everything a child makes
is its own. A request with `"deathsig": true` gives the child PR_SET_PDEATHSIG (SIGKILL): it dies with the
zygote, which ends when the pytest process does (its stdin closes), so a pytest killed with -9 leaves no such
child behind.

Protocol (JSON lines; requests on the zygote's stdin, answers on its stdout):
    -> {"id": N, "module": M, "args": [...], "env": {...}, "cwd": D, "log": PATH, "err": PATH | null,
        "title": T, "deathsig": B}
    <- {"ready": true, "seconds": S, "threads": T}     once, after the imports
    <- {"id": N, "pid": P}                              the child started
    <- {"exited": P, "code": C}                         a child ended (C as Popen.returncode)
The zygote exits (os._exit) when its stdin closes (the pytest process ended). `Zygote` is the client side.
"""

from __future__ import annotations

import atexit
import ctypes
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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
_PR_SET_PDEATHSIG = 1

# --- the zygote process ----------------------------------------------------------------------------------


def _preload(modules: Sequence[str]) -> None:
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # not in this version
        except Exception:  # the child that imports it reports it
            traceback.print_exc()


def _set_title(title: str) -> None:
    """What `ps` shows for the child (a fork keeps the zygote's command line otherwise)."""
    try:
        import setproctitle  # where installed (SGLang's dependencies, .sglang/deps)
    except ImportError:
        return
    setproctitle.setproctitle(title)


def exit_status(exc: SystemExit) -> int:
    """The status an interpreter leaving by `exc` exits with (a message instead of a number: printed, status 1)."""
    if exc.code is None or isinstance(exc.code, int):
        return exc.code or 0
    print(exc.code, file=sys.stderr)
    return 1


def _child(request: dict[str, Any], channel: tuple[int, int]) -> None:
    """In the forked child: become `python -m MODULE ARGS` and never return into the zygote's loop."""
    code = 1
    try:
        os.setsid()
        if request.get("deathsig"):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
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
        _set_title(request.get("title") or f"python -m {request['module']} {' '.join(request['args'])}")
        # The preloaded copy of the module (imported by the others) stays; its code runs again as __main__, as
        # `python -m` runs it. runpy warns about exactly that.
        warnings.filterwarnings(
            "ignore", message=".*found in sys.modules after import of package", category=RuntimeWarning
        )
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exit_status(exc)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def serve_forever(preload: Sequence[str]) -> None:
    """The zygote's loop: import `preload` (modules a version lacks are passed over), then fork a child per
    request and report each child's end; leaves with os._exit once stdin closes (no interpreter shutdown: with
    SGLang loaded it took seconds, which the pytest process would wait for at its own end)."""
    started = time.monotonic()
    channel = (os.dup(0), os.dup(1))  # the protocol; fds 0/1 become /dev/null and stderr for everything else
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    _preload(preload)
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
            if not data:  # the pytest process is done or gone
                sys.stdout.flush()
                sys.stderr.flush()
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


# --- the client side (the pytest process) --------------------------------------------------------------------


class ZygoteProcess:
    """A child of a zygote; the parts of `subprocess.Popen` the harnesses use."""

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
"""A zygote with no live child and no request for this long is ended (an SGLang one holds about 600 MB); the
next request of its name starts a new one."""


class Retired(Exception):
    """The zygote was ended for idleness before this request reached it: ask a new one."""


class Zygote:
    """A zygote process (`argv`: its command line, which calls `serve_forever`), started at once; `spawn` waits
    until its imports are done."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.log = Path(tempfile.gettempdir()) / f"{name}-zygote-{os.getpid()}.log"
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
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
                cwd=REPO,
                start_new_session=True,  # a Ctrl-C to pytest does not reach it; it ends when its stdin closes
            )
        threading.Thread(target=self._read, name=f"zygote-{name}", daemon=True).start()
        threading.Thread(target=self._retire_when_idle, name=f"zygote-idle-{name}", daemon=True).start()

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
        return RuntimeError(f"{self.name} zygote ({self.log}) {what}: {tail}")

    def spawn(
        self,
        module: str,
        args: list[str],
        env: dict[str, str],
        log: Path,
        timeout: float,
        err: Path | None = None,
        *,
        cwd: Path = REPO,
        title: str | None = None,
        deathsig: bool = False,
    ) -> ZygoteProcess:
        """`python -m module args` with `env` in `cwd`, stdout and stderr appended to `log` (stderr to `err` when
        given), forked once the zygote's imports are done (waits up to `timeout` for them). `deathsig`: the child
        is killed when the zygote ends."""
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
            request = {"id": request_id, "module": module, "args": args, "env": env, "cwd": str(cwd)}
            request |= {"log": str(log), "err": str(err) if err else None, "title": title, "deathsig": deathsig}
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
        """End the zygote (its children without `deathsig` live on: their owners kill them) and remove its log."""
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


_zygotes: dict[str, Zygote] = {}
_zygotes_lock = threading.Lock()


def zygote(name: str, argv: list[str], env: dict[str, str]) -> Zygote:
    """This process's zygote `name` (started on first use with `argv` and `env`; closed when the process exits or
    after IDLE_SECONDS without a child)."""
    with _zygotes_lock:
        found = _zygotes.get(name)
        if found is None or found._closed or found.retired:
            if found is not None:
                found.close()  # reaped
            found = _zygotes[name] = Zygote(name, argv, env)
        return found


def spawn(
    name: str, argv: list[str], zygote_env: dict[str, str], module: str, args: list[str], **request: Any
) -> ZygoteProcess:
    """`Zygote.spawn(module, args, **request)` on this process's zygote `name` (a new one when it was just
    retired)."""
    while True:
        try:
            return zygote(name, argv, zygote_env).spawn(module, args, **request)
        except Retired:
            continue


@atexit.register
def _close_all() -> None:
    for found in list(_zygotes.values()):
        found.close()
