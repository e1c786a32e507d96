"""Page-locking (CUDA pinning) of staging mappings, and undoing it before a mapping goes away.

A staging buffer's mapping is registered with `cudaHostRegister` so device-to-host copies run at pinned
bandwidth. The registration belongs to the mapping: it is undone (`cudaHostUnregister`) before the buffer
unmaps, grows into a new mapping or is closed, so no pinned range outlives its memory. A registration CUDA
refuses (e.g. the locked-memory limit) is logged with CUDA's reason and the copy falls back to pageable
memory; that mapping is not tried again.

`HostPinner` is the narrow interface over the CUDA runtime, so the bookkeeping imports and runs on a CPU-only
machine; `CudaHostPinner` is the real one.
"""

from __future__ import annotations

import logging
from typing import Protocol

log = logging.getLogger(__name__)


class HostPinner(Protocol):
    """Registers host memory with the CUDA runtime. Each call returns None on success, else CUDA's reason."""

    def register(self, ptr: int, size: int) -> str | None: ...

    def unregister(self, ptr: int) -> str | None: ...


class CudaHostPinner:
    """`HostPinner` over `torch.cuda.cudart()` (needs a CUDA build of torch and a device)."""

    def register(self, ptr: int, size: int) -> str | None:
        import torch

        return self._reason(torch.cuda.cudart().cudaHostRegister(ptr, size, 0))

    def unregister(self, ptr: int) -> str | None:
        import torch

        return self._reason(torch.cuda.cudart().cudaHostUnregister(ptr))

    @staticmethod
    def _reason(err: object) -> str | None:
        code = int(err)  # type: ignore[call-overload]  # a cudaError enum
        if code == 0:
            return None
        name = getattr(err, "name", "")
        return f"cudaError {code}{f' ({name})' if name else ''}"


class Pin:
    """The pinned state of one mapping (`ptr`, `size`): registered at most once, unregistered at most once."""

    def __init__(self, ptr: int, size: int) -> None:
        self.ptr = ptr
        self.size = size
        self.pinner: HostPinner | None = None  # set while registered
        self.refused: str | None = None  # CUDA's reason when registering failed (not tried again)

    @property
    def pinned(self) -> bool:
        return self.pinner is not None

    def register(self, pinner: HostPinner) -> bool:
        """Page-lock the mapping (idempotent); False, logged with the reason, when CUDA refuses."""
        if self.pinner is not None:
            return True
        if self.refused is not None:
            return False
        try:
            reason = pinner.register(self.ptr, self.size)
        except Exception as exc:  # no CUDA runtime to ask: same fallback
            reason = f"{type(exc).__name__}: {exc}"
        if reason is not None:
            self.refused = reason
            log.warning(
                "cannot pin %d bytes of staging memory at 0x%x (cudaHostRegister: %s); device copies of this "
                "buffer use pageable memory (slower)",
                self.size,
                self.ptr,
                reason,
            )
            return False
        self.pinner = pinner
        return True

    def unregister(self) -> None:
        """Undo the registration (before the mapping is unmapped); a failure is logged, never raised."""
        pinner, self.pinner = self.pinner, None
        if pinner is None:
            return
        try:
            reason = pinner.unregister(self.ptr)
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
        if reason is not None:
            log.warning("cudaHostUnregister of staging memory at 0x%x failed: %s", self.ptr, reason)
