"""`python SCRIPT ARGS` for test processes, forked from tests/helpers/preloaded.py's forkserver (torch, DCS and
tests.checkpoint_support already imported there) instead of a fresh interpreter paying for those imports again.

The child is what `python SCRIPT ARGS` starts: its own session, environment, working directory, argv, stdin
/dev/null, stdout and stderr to files; `sys.path` starts with the script's directory and then PYTHONPATH's entries
(as the interpreter builds it); the script runs as `__main__` from its path (so a `multiprocessing` spawn of one
of its functions re-runs it by path, as for a script run by the interpreter); and its atexit handlers run when it
ends, as at an interpreter's exit. It exits with the script's status (`SystemExit(n)`: n; an exception: 1).
"""

from __future__ import annotations

import atexit
import os
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.helpers.preloaded import REPO, PreloadedProcess, _forkserver, become_fresh_process


def _run_script(path: str, args: list[str], env: dict[str, str], cwd: str, out: str, err: str) -> None:
    """In the forked child: the process `python path args` would be, its stdout in `out`, its stderr in `err`."""
    become_fresh_process(env, cwd, stdout=out, stderr=err)
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.path.dirname(path), *extra, *(p for p in sys.path if p not in extra)]
    sys.argv = [path, *args]
    try:
        runpy.run_path(path, run_name="__main__")
    finally:
        atexit._run_exitfuncs()  # what the interpreter runs at exit (a multiprocessing child skips them)


class ScriptProcess(PreloadedProcess):
    """A started `python SCRIPT ARGS`; the parts of `subprocess.Popen` the tests use."""

    def __init__(self, script: Path, args: list[str], out: Path, err: Path, env: dict[str, str], cwd: Path) -> None:
        self.log = out
        self.args = [str(script), *args]
        target_args = (str(script), args, dict(env), str(cwd), str(out), str(err))
        self._process = _forkserver().Process(target=_run_script, args=target_args, daemon=False)
        self._process.start()
        assert self._process.pid is not None
        self.pid: int = self._process.pid


def run_script(
    script: Path, *args: str, workdir: Path, env: dict[str, str], cwd: Path = REPO, timeout: float
) -> subprocess.CompletedProcess[str]:
    """`subprocess.run([python, script, *args], env=env, cwd=cwd, capture_output=True, text=True,
    timeout=timeout)`, forked from the preloaded forkserver; the output goes through files under `workdir`. A
    process still running at `timeout` is killed with its process group and TimeoutExpired is raised."""
    workdir.mkdir(parents=True, exist_ok=True)
    handle, out_name = tempfile.mkstemp(prefix="out-", dir=workdir)
    os.close(handle)
    out, err = Path(out_name), Path(out_name + ".err")
    proc = ScriptProcess(script, list(args), out, err, env, cwd)
    try:
        code = proc.wait(timeout)
    finally:
        proc.kill()
    stderr = err.read_text(errors="replace") if err.exists() else ""
    return subprocess.CompletedProcess([str(script), *args], code, out.read_text(errors="replace"), stderr)
