"""Run a command under a child subreaper, to see whether it left any process behind.

The wrapper (a separate Python process) marks itself PR_SET_CHILD_SUBREAPER, runs the command, forwards
SIGINT/SIGTERM to it, and once it exited lists its own children: every process the command started and
did not reap itself (still running, or killed by the parent-death signal only because its parent exited)
is reparented to the wrapper, so an empty list means the command stopped all of its processes. The
leftovers are then killed and reaped, and their pids and command lines written as JSON.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.helpers.procs import REPO

WRAPPER = r"""
import ctypes, json, os, signal, subprocess, sys, time

PR_SET_CHILD_SUBREAPER = 36
if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
    sys.exit("prctl(PR_SET_CHILD_SUBREAPER) failed")
report = sys.argv[1]
# A user's shell starts `dcs` with SIGINT and SIGTERM unblocked and handled by default; a test process may not
# (a thread of the test runner can have them blocked, and a mask is inherited): start the command as a shell
# would, and note what this process inherited (read by the tests when a signal seems lost)
with open("/proc/self/status") as f:
    inherited = [line.strip() for line in f if line.startswith(("SigBlk", "SigIgn"))]
with open(report + ".signals", "w") as f:
    f.write(" ".join(inherited))
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.signal(signal.SIGTERM, signal.SIG_DFL)
proc = subprocess.Popen(sys.argv[2:])
for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, lambda s, _f: proc.send_signal(s))
rc = proc.wait()
time.sleep(0.5)


def children():
    found = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/children") as f:
            found += [int(p) for p in f.read().split()]
    return found


left = []
for pid in children():
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        cmd, state = "?", "?"
    left.append({"pid": pid, "cmd": cmd, "state": state})
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
deadline = time.monotonic() + 10
while time.monotonic() < deadline:
    try:
        if os.waitpid(-1, os.WNOHANG) == (0, 0):
            time.sleep(0.05)
    except ChildProcessError:
        break
with open(report, "w") as f:
    json.dump(left, f)
sys.exit(rc if rc >= 0 else 128 - rc)
"""


def clean_env(**extra: str) -> dict[str, str]:
    """A minimal environment: no DCS_* settings from the caller, the repository importable."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/tmp")}
    env["PYTHONPATH"] = str(REPO)
    env.update(extra)
    return env


def start_reaped(args: list[str], report: Path, env: dict[str, str], cwd: Path) -> subprocess.Popen[str]:
    """Start `python -m dcs_tasks.cli.main ARGS` under the subreaper wrapper, stdout piped (text)."""
    argv = [sys.executable, "-c", WRAPPER, str(report), sys.executable, "-m", "dcs_tasks.cli.main", *args]
    return subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd, start_new_session=True
    )


def inherited_signals(report: Path) -> str:
    """The wrapper's inherited blocked and ignored signal masks (`SigBlk: ... SigIgn: ...`, hex)."""
    side = report.with_name(report.name + ".signals")
    return side.read_text() if side.exists() else "(not written)"


def interrupt(proc: subprocess.Popen[str], report: Path, timeout: float = 90) -> str:
    """Ctrl-C: SIGINT to the wrapper (forwarded to the command); the rest of its output once it exited. A
    command still running after `timeout` fails the test with what the wrapper inherited."""
    proc.send_signal(signal.SIGINT)
    try:
        rest, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        output = exc.output if isinstance(exc.output, str) else (exc.output or b"").decode(errors="replace")
        raise AssertionError(
            f"still running {timeout}s after SIGINT; the wrapper started with {inherited_signals(report)}\n{output}"
        ) from None
    return rest


def leftovers(report: Path) -> list[dict[str, Any]]:
    """The processes the command left behind (see the module docstring)."""
    result: list[dict[str, Any]] = json.loads(report.read_text())
    return result


def kill_wrapper(proc: subprocess.Popen[str]) -> None:
    """Test clean-up: SIGKILL the wrapper's whole session if it is still running."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)
