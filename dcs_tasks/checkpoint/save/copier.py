"""Host-memory copies into the staging mapping: plain `memmove` in a few threads, no OpenMP.

Torch's `copy_` runs an OpenMP team per call; on a busy host (other processes on the cores) the team's
barriers make a 1 GiB copy 2-5x slower than one `memmove` (measured on the 2-core CI machines). ctypes
releases the GIL during the call, so `threads` workers each `memmove` their share of the chunks.
Only contiguous CPU tensors go this way; everything else uses `Tensor.copy_`.
"""

from __future__ import annotations

import ctypes
import os
from concurrent.futures import ThreadPoolExecutor

from dcs_tasks.checkpoint.format.iosizes import COPY_CHUNK_BYTES

CHUNK_BYTES = COPY_CHUNK_BYTES

_libc = ctypes.CDLL(None)
_memmove = _libc.memmove
_memmove.restype = ctypes.c_void_p
_memmove.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)

Job = tuple[int, int, int]  # (destination address, source address, bytes)


def default_threads() -> int:
    return max(1, min(4, os.cpu_count() or 1))


def _run(jobs: list[Job]) -> None:
    for dst, src, n in jobs:
        _memmove(dst, src, n)


class HostCopier:
    """Copies byte ranges between live buffers. The caller keeps both sides alive during `copy`."""

    def __init__(self, threads: int | None = None) -> None:
        self.threads = threads or default_threads()
        self._pool = ThreadPoolExecutor(self.threads, "dcs-copy") if self.threads > 1 else None

    def copy(self, jobs: list[Job]) -> None:
        chunks = [(d + o, s + o, min(CHUNK_BYTES, n - o)) for d, s, n in jobs for o in range(0, n, CHUNK_BYTES)]
        if self._pool is None or len(chunks) < 2:
            _run(chunks)
            return
        shares: list[list[Job]] = [[] for _ in range(self.threads)]
        loads = [0] * self.threads
        for chunk in sorted(chunks, key=lambda c: -c[2]):
            i = loads.index(min(loads))
            shares[i].append(chunk)
            loads[i] += chunk[2]
        for future in [self._pool.submit(_run, share) for share in shares if share]:
            future.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
