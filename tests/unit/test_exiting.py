"""dcs_tasks/checkpoint/exiting.py in real processes: SIGTERM at its default action deletes the staging files no
save holds and still ends the process by SIGTERM; a program's own SIGTERM handler is left alone; a forked child
that exits closes nothing of its parent's; interpreter exit closes what is still open."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from tests.helpers.procs import REPO

PRELUDE = """
import os, signal, sys, time
from pathlib import Path
from dcs_tasks.checkpoint import exiting
from dcs_tasks.checkpoint.save.staging import StagingPool

directory = Path(sys.argv[1])
pool = StagingPool(directory, 2, prefix="dcs-dcs-exits")
pool.reserve(1 << 20)

class Closing:
    def close(self, timeout=None):
        (directory / f"closed-by-{os.getpid()}").write_text(str(timeout))
        pool.close()

ckpt = Closing()
"""


def _run(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    script = PRELUDE + body
    command = [sys.executable, "-c", script, str(tmp_path)]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)


def _stage_files(tmp_path: Path) -> list[Path]:
    return sorted(tmp_path.glob("*.stage"))


def test_sigterm_at_its_default_deletes_the_free_buffers_and_still_ends_the_process(tmp_path: Path) -> None:
    done = _run(tmp_path, "exiting.track(ckpt, pool)\nos.kill(os.getpid(), signal.SIGTERM)\ntime.sleep(30)\n")
    assert done.returncode == -signal.SIGTERM, done.stderr
    assert _stage_files(tmp_path) == []


def test_a_programs_own_sigterm_handler_is_left_alone(tmp_path: Path) -> None:
    body = (
        "signal.signal(signal.SIGTERM, lambda *_: print('mine', flush=True) or sys.exit(3))\n"
        "exiting.track(ckpt, pool)\nos.kill(os.getpid(), signal.SIGTERM)\ntime.sleep(30)\n"
    )
    done = _run(tmp_path, body)
    assert done.returncode == 3 and "mine" in done.stdout, done.stderr
    assert _stage_files(tmp_path) == []  # its sys.exit ran the atexit close
    assert [p.name for p in tmp_path.glob("closed-by-*")] != []


def test_a_forked_child_closes_nothing_of_its_parents_and_exit_closes_the_rest(tmp_path: Path) -> None:
    body = (
        "exiting.track(ckpt, pool)\n"
        "child = os.fork()\n"
        "if child == 0:\n"
        "    sys.exit(0)\n"
        "os.waitpid(child, 0)\n"
        "print(len(list(directory.glob('*.stage'))), len(list(directory.glob('closed-by-*'))), flush=True)\n"
    )
    done = _run(tmp_path, body)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["2", "0"]  # after the child's exit: both buffers there, nothing closed
    assert _stage_files(tmp_path) == []  # the parent's own exit closed its checkpointer
    closed = list(tmp_path.glob("closed-by-*"))
    assert len(closed) == 1 and 0 <= float(closed[0].read_text()) <= 10.0  # once, by the parent, bounded
