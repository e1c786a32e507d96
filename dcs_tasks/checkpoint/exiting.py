"""A trainer's staging files go away however its process ends, not only through `Checkpointer.close()`.

The staging buffers are files in tmpfs: nothing frees them when a trainer forgets `close()`, dies by an
exception or is stopped by SIGTERM, and each holds up to the size of a whole training state. So every open
`Checkpointer` is tracked here (weakly) by the process that made it:

- at interpreter exit (a normal end, an uncaught exception, `sys.exit`), `atexit` closes each one still open,
  waiting at most `EXIT_WAIT_SECONDS` (all of them together) for their saves in flight (a worker is reading
  their buffers), then deleting every buffer file that no save still needs;
- on SIGTERM, when the process left SIGTERM at its default action and the first Checkpointer is made in the main
  thread, a handler deletes the buffer files no save holds, then lets SIGTERM end the process as before (the
  default action again, the signal raised again). It takes no lock and waits for nothing: it may run while the
  main thread holds any of them. A handler the program installed itself is left alone (a program that exits
  from it by `sys.exit` gets the `atexit` close).

The file of a save still in flight stays for the worker reading it; a later trainer of the run removes it once
its writer is dead (`staging.remove_orphans`), and `dcs clean` does on a host where no DCS process runs. A
kill -9 leaves every file: the same two remove them. A forked child (a DataLoader worker) never closes its
parent's checkpointers: the tracked set belongs to the pid that filled it.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import threading
import time
import weakref
from types import FrameType
from typing import Protocol

from dcs_tasks.checkpoint.save.staging import StagingPool
from dcs_tasks.errors import DCSError

log = logging.getLogger(__name__)
EXIT_WAIT_SECONDS = 10.0  # at interpreter exit, how long the open checkpointers wait for saves in flight


class Closable(Protocol):
    def close(self, timeout: float | None = None) -> object: ...


class _Tracked:
    """The open checkpointers and their pools of the process `pid` (module docstring)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.checkpointers: weakref.WeakSet[Closable] = weakref.WeakSet()
        self.pools: weakref.WeakSet[StagingPool] = weakref.WeakSet()
        self.hooks_installed = False


_tracked = _Tracked()
_lock = threading.Lock()


def track(checkpointer: Closable, pool: StagingPool) -> None:
    """Close `checkpointer` at exit and delete `pool`'s free files on SIGTERM, unless it is closed before."""
    global _tracked
    with _lock:
        if _tracked.pid != os.getpid():  # a forked child: its parent's set is not its own
            _tracked = _Tracked()
        _tracked.checkpointers.add(checkpointer)
        _tracked.pools.add(pool)
        if not _tracked.hooks_installed:
            _tracked.hooks_installed = True
            atexit.register(_close_all, _tracked)
            _install_sigterm()


def _close_all(tracked: _Tracked) -> None:
    if tracked.pid != os.getpid():
        return
    deadline = time.monotonic() + EXIT_WAIT_SECONDS  # one bound for all of them
    for checkpointer in list(tracked.checkpointers):
        try:
            checkpointer.close(timeout=max(0.0, deadline - time.monotonic()))  # closing again returns at once
        except (DCSError, OSError) as exc:  # exiting anyway: say it, and go on with the next one
            log.error("closing a checkpointer at exit: %s: %s", type(exc).__name__, exc)


def _install_sigterm() -> None:
    """Our handler for SIGTERM, only where the process left its default action and only from the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return
    with contextlib.suppress(ValueError, OSError):
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum: int, _frame: FrameType | None) -> None:
    """Delete the staging files no save holds, then end by SIGTERM's default action (module docstring)."""
    tracked = _tracked
    if tracked.pid == os.getpid():
        for pool in list(tracked.pools):
            pool.unlink_free_files()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
