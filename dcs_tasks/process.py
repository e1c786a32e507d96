"""Facts about local processes (no I/O beyond a signal-0 probe)."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """True when a process with `pid` exists on this host (in this pid namespace); a process owned by
    another user counts as alive."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
