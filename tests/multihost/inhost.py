"""Python processes of a simulated host forked from the preloaded forkserver (tests/helpers/preloaded.py) instead of
started as `nsenter ... python -m MODULE`: a trainer rank, a weight-sync actor or a `dcs receiver` imports torch and
DCS first, 3-5 s of CPU each on a 2-core machine, and a multi-host test starts up to eight of them.

The forked child enters the host's namespaces itself before it runs anything: setns(2) into the network, UTS and
mount namespaces of the host's init process (what `nsenter --net --uts --mount` does; the child is single-threaded,
as a mount namespace requires), then a session of its own, the working directory, the environment, argv, and runs
the module as `__main__`. So it has the host's hostname, address, routes and /dev/shm, and `ip netns pids` finds it
(the harness's clean-up kills it with the host). Only the import is shared. A process whose command line matters
(`dcs worker` re-execs itself; redis-server, haproxy, `dcs coordinator`) stays a `nsenter` command line.

stdin and stdout of a driven process (`pipes=True`) are one end of a socket pair (the test holds the other:
`proc.stdin` / `proc.stdout` as Popen's pipes are); stderr, and stdout of an undriven one, go to the log.
"""

from __future__ import annotations

import ctypes
import io
import os
import runpy
import socket
import subprocess
import sys
from pathlib import Path
from typing import IO

from tests.helpers.preloaded import _forkserver, become_fresh_process

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWNET = 0x40000000
NAMESPACES = (("net", CLONE_NEWNET), ("uts", CLONE_NEWUTS), ("mnt", CLONE_NEWNS))


def enter_host(init_pid: int) -> None:
    """setns(2) this (single-threaded) process into the network, UTS and mount namespaces of `init_pid`."""
    libc = ctypes.CDLL(None, use_errno=True)
    fds = [(name, flag, os.open(f"/proc/{init_pid}/ns/{name}", os.O_RDONLY)) for name, flag in NAMESPACES]
    try:
        for name, flag, fd in fds:
            if libc.setns(fd, flag) != 0:
                errno = ctypes.get_errno()
                raise OSError(errno, f"setns into the {name} namespace of pid {init_pid}: {os.strerror(errno)}")
    finally:
        for _, _, fd in fds:
            os.close(fd)


def _child(
    init_pid: int, module: str, args: list[str], env: dict[str, str], cwd: str, log: str, pipe: socket.socket | None
) -> None:
    """In the forked child: `python -m module args` as started inside the host (its namespaces entered before
    the working directory is taken); with `pipe`, stdin and stdout are that socket, stderr the log."""
    if pipe is not None:
        become_fresh_process(
            env, cwd, stdout=pipe.fileno(), stderr=log, stdin=pipe.fileno(), then=lambda: enter_host(init_pid)
        )
        pipe.close()
    else:
        become_fresh_process(env, cwd, stdout=log, then=lambda: enter_host(init_pid))
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True)
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


class HostChild:
    """A started `python -m MODULE ARGS` inside a host; the parts of `subprocess.Popen` the harness uses (`pid`,
    `poll`, `wait`, `send_signal`, and with `pipes` `stdin`/`stdout`)."""

    def __init__(
        self, init_pid: int, module: str, args: list[str], env: dict[str, str], cwd: Path, log: Path, pipes: bool
    ) -> None:
        self.args = [module, *args]
        ours, theirs = socket.socketpair() if pipes else (None, None)
        self._process = _forkserver().Process(
            target=_child, args=(init_pid, module, args, env, str(cwd), str(log), theirs), daemon=False
        )
        try:
            self._process.start()
        finally:
            if theirs is not None:
                theirs.close()  # the child's end: when it exits, reads here see the end of the stream
        assert self._process.pid is not None
        self.pid: int = self._process.pid
        self.stdin: IO[bytes] | None = ours.makefile("wb") if ours is not None else None
        self.stdout: IO[bytes] | None = ours.makefile("rb") if ours is not None else None
        self._socket = ours

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
        if self._process.exitcode is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass
