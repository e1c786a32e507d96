"""Keep `dcs worker` consuming after Celery gives up: re-exec it after an unrecoverable error.

Celery 5.7 / kombu 5.7 log "Unrecoverable error" and stop the worker when Redis restarts or fails over
while a late-ack task is unacknowledged (kombu's `restore_unacked` runs on a torn-down connection:
`AttributeError: 'NoneType' object has no attribute 'hostname'`; celery#9250 class). The process then
stops without a shutdown signal, and `dcs worker` replaces itself by a fresh one (`reexec`), whose start-up
takes back the tasks the old one left unacknowledged (workers/recovery.py).

That stop is a warm shutdown, and Celery's own comment says a silent broker can wedge it. In CI a worker
logged the unrecoverable error during a Sentinel failover and then neither consumed nor exited for over
45 s. `SelfRestartingWorker` bounds that: when a stop begins without a shutdown signal, a watchdog thread
re-execs the process after `DCSConfig.worker_stuck_stop_seconds` (15 s by default) unless it has exited (or
re-exec'd) by then, killing the pool's child processes first (their tasks are late-ack: they are delivered
again; a task finishing during that stop could not be acknowledged on the closed connection anyway).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from celery.apps.worker import Worker as CeleryWorker

log = logging.getLogger(__name__)
RESTART_DELAY_SECONDS = 1.0

lifecycle: dict[str, float] = {"ready": 0, "shutdown_requested": 0, "max_restarts": 0, "stuck_stop_seconds": 15.0}


def on_ready(**_: Any) -> None:
    lifecycle["ready"] = 1


def on_shutdown_requested(**_: Any) -> None:
    lifecycle["shutdown_requested"] = 1


def should_restart() -> bool:
    """The worker ran and is stopping without a shutdown signal, and restarts are left."""
    return bool(lifecycle["ready"]) and not lifecycle["shutdown_requested"] and int(lifecycle["max_restarts"]) > 0


def reexec(restarts_left: int) -> None:
    """Replace this process by a fresh `dcs worker` (queued tasks are kept by Redis)."""
    log.warning("worker stopped without a shutdown signal; restarting it (%d restarts left)", restarts_left)
    time.sleep(RESTART_DELAY_SECONDS)
    argv = [a for a in sys.orig_argv if not a.startswith("--max-restarts")]
    os.execv(sys.executable, [sys.executable, *argv[1:], f"--max-restarts={restarts_left}"])  # noqa: S606


def child_pids(parent: int) -> list[int]:
    """The live child processes of `parent` (Linux /proc)."""
    found: list[int] = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == parent:
                found.append(int(stat.parent.name))
    return found


def _watchdog(seconds: float) -> None:
    time.sleep(seconds)
    log.warning("the worker's stop after an unrecoverable error is still running after %gs: restarting now", seconds)
    for pid in child_pids(os.getpid()):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    reexec(int(lifecycle["max_restarts"]) - 1)


class SelfRestartingWorker(CeleryWorker):
    """Celery's worker whose stop after an unrecoverable error cannot hang the process (module docstring)."""

    def stop(self, in_sighandler: bool = False, exitcode: int | None = None) -> None:
        if should_restart():
            seconds = lifecycle["stuck_stop_seconds"]
            watchdog = threading.Thread(target=_watchdog, args=(seconds,), name="dcs-stop-watchdog")
            watchdog.daemon = True
            watchdog.start()
        super().stop(in_sighandler=in_sighandler, exitcode=exitcode)
