"""xxh3-128 of memory at an address without holding the GIL, so several files hash on several cores.

The `xxhash` package's `update` keeps the GIL (measured: two threads hashing 128 MiB each take as long as one
after the other). Its extension module exports libxxhash's C API, and ctypes releases the GIL around every
foreign call, so `digest(address, size)` runs there through the same CPU-dispatched code (`*_dispatch`: the
same speed as `xxhash.xxh3_128`) and gives the same hex digest as `xxhash.xxh3_128().hexdigest()`; `Hasher` is
the streaming form (`update`, `hexdigest`), which `layout.new_hasher()` hands out. Where the symbols are missing
(another build of `xxhash`), `available()` is False and callers hash with `xxhash` itself.

Why it matters beyond several files at once: an S3 upload hashes its parts in order on the task's thread while
8 threads send them (`storage/s3.py`); an `update` that keeps the GIL for the 3 ms a 32 MiB part takes stops every
sender for that long.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import numpy

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


class Hasher:
    """Streaming xxh3-128 (the `xxhash.xxh3_128` calls DCS makes: `update`, `hexdigest`), each `update` hashed
    without the GIL. Any contiguous buffer may be passed, read-only ones (bytes, a PROT_READ mapping) included."""

    def __init__(self) -> None:
        lib = _lib()
        if lib is None:
            raise RuntimeError("the xxhash extension does not export the XXH3 C API")
        self._lib = lib
        self._state = lib.XXH3_createState()
        if not self._state:
            raise MemoryError("XXH3_createState failed")
        lib.XXH3_128bits_reset(self._state)

    def update(self, data: Any) -> None:
        with memoryview(data) as view:
            size = view.nbytes
            if size == 0:
                return
            if not view.c_contiguous:
                raise BufferError("nogil.Hasher.update needs a contiguous buffer")
            # the address of a read-only buffer (ctypes' from_buffer wants a writable one); the array is dropped
            # before the view is released, so the caller's buffer keeps no export
            array = numpy.frombuffer(view, dtype=numpy.uint8)
            try:
                address = int(array.ctypes.data)
                for pos in range(0, size, STEP):
                    self._lib.XXH3_128bits_update_dispatch(self._state, address + pos, min(STEP, size - pos))
            finally:
                del array

    def hexdigest(self) -> str:
        value = self._lib.XXH3_128bits_digest(self._state)
        return f"{value.high64:016x}{value.low64:016x}"

    def __del__(self) -> None:
        state, self._state = getattr(self, "_state", None), None
        if state:
            self._lib.XXH3_freeState(state)
