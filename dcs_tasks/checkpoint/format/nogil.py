"""xxh3-128 of memory at an address without holding the GIL, so several files hash on several cores.

The `xxhash` package's `update` keeps the GIL (measured: two threads hashing 128 MiB each take as long as one
after the other). Its extension module exports libxxhash's C API, and ctypes releases the GIL around every
foreign call, so `digest(address, size)` runs there through the same CPU-dispatched code (`*_dispatch`: the
same speed as `xxhash.xxh3_128`) and gives the same hex digest as `new_hasher().hexdigest()`. Where the symbols
are missing (another build of `xxhash`), `available()` is False and callers hash with `new_hasher()`.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

STEP = 8 << 20  # bytes per foreign call


class _Hash128(ctypes.Structure):
    _fields_ = (("low64", ctypes.c_uint64), ("high64", ctypes.c_uint64))


@functools.cache
def _lib() -> Any:
    try:
        import xxhash._xxhash as extension

        lib = ctypes.CDLL(extension.__file__)
        lib.XXH3_createState.restype = ctypes.c_void_p
        lib.XXH3_freeState.argtypes = (ctypes.c_void_p,)
        lib.XXH3_128bits_reset.argtypes = (ctypes.c_void_p,)
        lib.XXH3_128bits_update_dispatch.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
        lib.XXH3_128bits_digest.argtypes = (ctypes.c_void_p,)
        lib.XXH3_128bits_digest.restype = _Hash128
    except (ImportError, OSError, AttributeError):
        return None
    return lib


def available() -> bool:
    return _lib() is not None


def digest(address: int, size: int) -> str:
    """xxh3-128 hex digest of `size` bytes at `address` (the caller keeps them mapped meanwhile)."""
    lib = _lib()
    if lib is None:
        raise RuntimeError("the xxhash extension does not export the XXH3 C API")
    state = lib.XXH3_createState()
    if not state:
        raise MemoryError("XXH3_createState failed")
    try:
        lib.XXH3_128bits_reset(state)
        for pos in range(0, size, STEP):
            lib.XXH3_128bits_update_dispatch(state, address + pos, min(STEP, size - pos))
        value = lib.XXH3_128bits_digest(state)
    finally:
        lib.XXH3_freeState(state)
    return f"{value.high64:016x}{value.low64:016x}"
