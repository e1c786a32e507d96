"""A device runtime on CPU for the device pipelines' tests (`restore.device.DeviceCopier`, `save.cuda`'s streams):
"device" tensors are CPU tensors the test names, and every queued copy runs late, only when an event or the
stream is synchronised, as a real side stream may. So a pipeline that reuses a page-locked slot before its copy
ran, reads a target before the copy landed, or forgets the final synchronisation copies the wrong bytes, and the
test sees it. Each copy also checks, when it finally runs, that its source bytes are still those it was queued
with (`violations`), and that they come from page-locked memory (`unpinned`).
"""

from __future__ import annotations

import hashlib
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


class FakeStream:
    """Queued work that runs only when waited for."""

    def __init__(self, device: torch.device, gate: threading.Event | None = None) -> None:
        self.device = device
        self.queue: deque[Callable[[], None]] = deque()
        self.ran = 0  # operations run so far
        self.queued = 0
        self.gate = gate  # while clear, nothing runs (a copy still in flight on the "device")
        self._lock = threading.Lock()

    def enqueue(self, op: Callable[[], None]) -> None:
        self.queue.append(op)
        self.queued += 1

    def run_until(self, upto: int) -> None:
        if self.gate is not None and self.ran < upto and not self.gate.wait(30):
            raise TimeoutError("the test never let the fake stream run")
        with self._lock:
            while self.ran < upto:
                op = self.queue.popleft()
                self.ran += 1
                op()

    # the torch.cuda.Stream surface `save.cuda.DeviceStager` uses
    def wait_stream(self, other: Any) -> None:
        pass

    def synchronize(self) -> None:
        self.run_until(self.queued)


@dataclass
class FakeEvent:
    stream: FakeStream
    upto: int

    def synchronize(self) -> None:
        self.stream.run_until(self.upto)

    def query(self) -> bool:
        return self.stream.ran >= self.upto


@dataclass
class RecordingPinner:
    """`HostPinner` that records (or refuses) registrations."""

    refuse: bool = False
    registered: dict[int, int] = field(default_factory=dict)  # ptr -> size, while registered
    calls: list[tuple[str, int, int]] = field(default_factory=list)

    def register(self, ptr: int, size: int) -> str | None:
        self.calls.append(("register", ptr, size))
        if self.refuse:
            return "cudaError 712 (refused by the test)"
        self.registered[ptr] = size
        return None

    def unregister(self, ptr: int) -> str | None:
        self.calls.append(("unregister", ptr, self.registered.pop(ptr, -1)))
        return None


class FakeCopier:
    """`DeviceCopier` over CPU tensors: the storages of `device_tensors` are the "device"."""

    def __init__(
        self, device_tensors: Iterable[torch.Tensor] = (), refuse_pinning: bool = False, fail_copies: bool = False
    ) -> None:
        self.pinner = RecordingPinner(refuse=refuse_pinning)
        self.gate = threading.Event()  # set: streams run when waited for; `hold()` clears it
        self.gate.set()
        self.fail_copies = fail_copies  # a copy raises when it runs (as a device fault surfaces at the event)
        self._device: set[int] = set()
        self.claim(device_tensors)
        self._pinned: list[torch.Tensor] = []
        self.streams: dict[str, FakeStream] = {}
        self.copies = 0
        self.syncs = 0  # stream synchronisations
        self.event_waits = 0
        self.violations: list[str] = []
        self.unpinned: list[str] = []

    def claim(self, tensors: Iterable[torch.Tensor]) -> None:
        """Treat these tensors as device tensors."""
        for t in tensors:
            self._device.add(t.untyped_storage().data_ptr())

    def on_device(self, tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage().data_ptr() in self._device

    def pinned(self, nbytes: int) -> torch.Tensor:
        t = torch.empty(nbytes, dtype=torch.uint8)
        self._pinned.append(t)
        return t

    def _is_pinned(self, t: torch.Tensor) -> bool:
        ptr = t.data_ptr()
        if any(p.data_ptr() <= ptr < p.data_ptr() + p.numel() for p in self._pinned):
            return True
        return any(base <= ptr < base + size for base, size in self.pinner.registered.items())

    def empty(self, like: torch.Tensor) -> torch.Tensor:
        t = torch.empty(like.shape, dtype=like.dtype)
        self.claim([t])
        return t

    def hold(self) -> None:
        """Queued copies do not run (waiters block) until `release()`."""
        self.gate.clear()

    def release(self) -> None:
        self.gate.set()

    def pending(self) -> int:
        """Copies queued that have not run yet."""
        return sum(s.queued - s.ran for s in self.streams.values())

    def stream(self, device: torch.device) -> FakeStream:
        return self.streams.setdefault(str(device), FakeStream(device, self.gate))

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: FakeStream) -> None:
        host = not self.on_device(src)  # a device source is written by earlier copies of the stream: in order
        if host and not self._is_pinned(src):
            self.unpinned.append(f"{src.numel()} bytes from pageable memory at 0x{src.data_ptr():x}")
        queued = _digest(src) if host else ""
        self.copies += 1

        def run() -> None:
            if self.fail_copies:
                raise RuntimeError("CUDA error: an illegal memory access was encountered (injected by the test)")
            if host and _digest(src) != queued:
                self.violations.append(f"source at 0x{src.data_ptr():x} changed before its copy ran")
            with torch.no_grad():
                dst.copy_(src)

        stream.enqueue(run)

    def record(self, stream: FakeStream) -> FakeEvent:
        outer = self

        class _Counted(FakeEvent):
            def synchronize(self) -> None:
                outer.event_waits += 1
                super().synchronize()

        return _Counted(stream, stream.queued)

    def synchronize(self, stream: FakeStream) -> None:
        self.syncs += 1
        stream.synchronize()
