"""Keep `dcs worker` consuming after Celery gives up: re-exec it after an unrecoverable error.

Celery 5.7 / kombu 5.7 log "Unrecoverable error" and stop the worker when Redis restarts or fails over
while a late-ack task is unacknowledged (kombu's `restore_unacked` runs on a torn-down connection:
`AttributeError: 'NoneType' object has no attribute 'hostname'`; celery#9250 class). The process then
stops without a shutdown signal, and `dcs worker` replaces itself by a fresh one (`reexec`), whose start-up
takes back the tasks the old one left unacknowledged (workers/recovery.py).

That stop is a warm shutdown, and Celery's own comment says a silent broker can wedge it. In CI a worker
logged the unrecoverable error during a Sentinel failover and then neither consumed nor exited for over
45 s. `SelfRestartingWorker` bounds that: when a stop begins without a shutdown signal, a watchdog thread
re-execs the process after `DCSConfig.task.worker_stuck_stop_seconds` (15 s by default) unless it has exited (or
re-exec'd) by then, killing the pool's child processes first (their tasks are late-ack: they are delivered
again; tasks are idempotent). A shutdown asked for meanwhile makes it exit(1) at the bound instead.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
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


_exec_lock = threading.Lock()  # the watchdog and the main thread may both get here: one exec, one log line


def reexec(restarts_left: int, delay: float = RESTART_DELAY_SECONDS) -> None:
    """Replace this process by a fresh `dcs worker` (queued tasks are kept by Redis)."""
    with _exec_lock:
        log.warning("worker stopped without a shutdown signal; restarting it (%d restarts left)", restarts_left)
        time.sleep(delay)
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


def _watchdog(seconds: float, pool_pids: Callable[[], list[int]]) -> None:
    time.sleep(seconds)
    pids = pool_pids()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for pid in pids:  # reap them: a zombie would outlive the exec as a child the new worker does not know
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, 0)
    if lifecycle["shutdown_requested"] or lifecycle["max_restarts"] <= 0:
        # a shutdown was asked for meanwhile, or no restart is left: end, and let the supervisor decide
        log.warning(
            "the worker's stop is still running after %gs: killed %d pool processes, exiting",
            seconds,
            len(pids),
        )
        os._exit(1)
    log.warning("the worker's stop after an unrecoverable error is still running after %gs: restarting now", seconds)
    reexec(int(lifecycle["max_restarts"]) - 1, delay=0.0)


class SelfRestartingWorker(CeleryWorker):
    """Celery's worker whose stop after an unrecoverable error cannot hang the process (module docstring)."""

    _watchdog_armed = False

    def stop(self, in_sighandler: bool = False, exitcode: int | None = None) -> None:
        if lifecycle["ready"] and not lifecycle["shutdown_requested"] and not self._watchdog_armed:
            self._watchdog_armed = True
            seconds = lifecycle["stuck_stop_seconds"]
            args = (seconds, self._pool_pids)
            watchdog = threading.Thread(target=_watchdog, args=args, name="dcs-stop-watchdog")
            watchdog.daemon = True
            watchdog.start()
        super().stop(in_sighandler=in_sighandler, exitcode=exitcode)

    def _pool_pids(self) -> list[int]:
        """The prefork pool's processes and every other child of this process (a pool process that is being
        replaced is a child without being listed by the pool yet); none for a thread pool."""
        found = set(child_pids(os.getpid()))
        with contextlib.suppress(Exception):  # the pool may be half torn down
            found.update(int(pid) for pid in self.pool.info.get("processes", []))
        return sorted(found)
