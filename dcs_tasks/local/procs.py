"""Child processes of a local stack: each in its own session (process group), logging to a file, stopped
group-wide, and killed by the kernel if the parent dies first (Linux `PR_SET_PDEATHSIG`).

Why a session per child: Ctrl-C in a terminal reaches only the parent, which then stops the children in
order (receivers, worker, coordinator, Redis) instead of all of them racing; and a stop signals the whole
group, so a child's own children (a prefork pool) go with it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import dcs_tasks
from dcs_tasks.errors import DCSError, DCSTimeoutError

PR_SET_PDEATHSIG = 1
POLL_SECONDS = 0.1


class LocalStackError(DCSError):
    """A process of the local stack could not be started, exited early or did not become ready."""


class StackInterrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived: treated like Ctrl-C so that every `finally` (and the stop) runs."""


def _pdeathsig_setter() -> Callable[[], None] | None:
    """A preexec function asking the kernel to SIGKILL the child when its parent dies (Linux only): a
    `kill -9` of `dcs up` or `dcs demo` then leaves nothing behind either. Resolved here, in the parent,
    so the child only makes one C call between fork and exec."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]

    def setter() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)

    return setter


PDEATHSIG = _pdeathsig_setter()


def source_root() -> Path | None:
    """The checkout holding `dcs_tasks` when it runs from a source tree (pyproject.toml beside it), so that
    children find `coordinator` and `workers` without an install; None for an installed package."""
    root = Path(dcs_tasks.__file__).resolve().parents[1]
    return root if (root / "pyproject.toml").is_file() and (root / "workers").is_dir() else None


def child_environ(dcs_env: dict[str, str], extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without any `DCS_*` variable, plus `dcs_env` (a config's `to_env()`)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DCS_", "FLOWER_"))}
    env.update(dcs_env)
    root = source_root()
    if root is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH", "")) if p)
    env.update(extra or {})
    return env


class Service:
    """One child process of the stack. `start` spawns it; `stop` ends its whole process group."""

    def __init__(self, name: str, argv: Sequence[str], env: dict[str, str], log_path: Path) -> None:
        self.name = name
        self.argv = list(argv)
        self.env = env
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    @classmethod
    def dcs(cls, name: str, args: Sequence[str], env: dict[str, str], log_path: Path) -> Service:
        """`python -m dcs_tasks.cli.main ARGS` with this interpreter (works without `dcs` on PATH)."""
        return cls(name, [sys.executable, "-m", "dcs_tasks.cli.main", *args], env, log_path)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> Service:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(  # preexec_fn only sets the parent-death signal
                self.argv,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=PDEATHSIG,
            )
        return self

    def exited(self) -> int | None:
        """The exit status once the process ended, else None."""
        return None if self.proc is None else self.proc.poll()

    def check_alive(self) -> None:
        code = self.exited()
        if code is not None:
            raise LocalStackError(f"{self.name} exited with status {code}; end of {self.log_path}:\n{self.tail()}")

    def tail(self, nbytes: int = 2000) -> str:
        try:
            with self.log_path.open("rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - nbytes))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def wait_until(self, ready: Callable[[], bool], timeout: float, what: str) -> None:
        """Poll `ready()` until true; LocalStackError if the process exits, DCSTimeoutError after `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            self.check_alive()
            with contextlib.suppress(Exception):  # not up yet: connection refused, 503, a Redis error
                if ready():
                    return
            if time.monotonic() >= deadline:
                tail = self.tail()
                raise DCSTimeoutError(f"{self.name}: {what} not within {timeout:.0f}s; log {self.log_path}:\n{tail}")
            time.sleep(POLL_SECONDS)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM to the group, up to `timeout` for the leader to exit, then SIGKILL to whatever of the group
        is left (signalled before the leader is reaped, so its group id cannot have been reused)."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            _signal_group(proc.pid, signal.SIGTERM)
            _wait_unreaped(proc.pid, timeout)
        _signal_group(proc.pid, signal.SIGKILL)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:  # unkillable (D state): nothing more a parent can do
            pass

    def kill(self) -> None:
        """SIGKILL the group at once (no clean shutdown)."""
        proc, self.proc = self.proc, None
        if proc is not None:
            _signal_group(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _wait_unreaped(pid: int, timeout: float) -> bool:
    """Wait for `pid` to exit without reaping it (it stays a zombie, holding its pid and group id)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is not None:
                return True
        except ChildProcessError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def _raise_interrupted(signum: int, _frame: FrameType | None) -> None:
    raise StackInterrupted(f"received {signal.Signals(signum).name}")


@contextlib.contextmanager
def interrupts_as_keyboard() -> Iterator[None]:
    """Within: SIGTERM and SIGHUP raise `StackInterrupted` (a KeyboardInterrupt) in the main thread, like
    Ctrl-C, so a stack's stop runs. Outside the main thread this does nothing."""
    if not _in_main_thread():
        yield
        return
    previous: dict[signal.Signals, Any] = {}
    for signum in (signal.SIGTERM, signal.SIGHUP):
        previous[signum] = signal.signal(signum, _raise_interrupted)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Within: SIGINT, SIGTERM and SIGHUP are ignored, so a second Ctrl-C cannot cut a stop short (every
    wait inside is bounded)."""
    if not _in_main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
