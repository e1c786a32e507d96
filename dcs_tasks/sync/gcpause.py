"""Hold off Python's cyclic garbage collector while a weight update is on the wire.

A full (generation 2) collection in a process holding torch, FastAPI and a model walks every tracked
object: ~0.1 s measured in a `dcs receiver`, i.e. a tenth of a 1 GiB update, and it lands on whichever
receiver happens to cross the threshold, stalling the whole group. An update allocates a bounded number
of objects, so pausing collection for its duration is safe; collection resumes (and catches up) when the
last overlapping update ends. Nested and concurrent pauses (threads, coroutines) are counted.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_depth = 0
_we_disabled = False


@contextmanager
def paused_gc(enabled: bool = True) -> Iterator[None]:
    """Disable the cyclic collector inside the block (a no-op when `enabled` is False or it is already off)."""
    global _depth, _we_disabled
    if not enabled:
        yield
        return
    with _lock:
        _depth += 1
        if _depth == 1 and gc.isenabled():
            gc.disable()
            _we_disabled = True
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _we_disabled:
                _we_disabled = False
                gc.enable()
