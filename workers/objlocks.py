"""The worker's locks of runs kept in an object store (`dcs_tasks.checkpoint.store.objlocks`, on its Redis)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from dcs_tasks.checkpoint.store import objlocks
from dcs_tasks.storage import ObjectPath
from workers.runtime import runtime


@contextlib.contextmanager
def run_lock(run_dir: ObjectPath, purpose: str) -> Iterator[None]:
    rt = runtime()
    with objlocks.run_lock(rt.redis, rt.keys, run_dir, purpose):
        yield
