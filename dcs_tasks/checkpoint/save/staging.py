"""Shared-memory staging pool: a few reusable files in `staging_dir` (tmpfs), mmapped by the trainer.

Each buffer holds the final bytes of every safetensors file of one save, one page-aligned region per
file; the worker maps the same file and streams regions to disk. Buffers are created and pre-faulted
(fallocate + populate) ahead of use and kept across saves, so the trainer's stall is one copy into
resident memory (DESIGN invariant 8). A buffer grows only when a bigger layout arrives.

Ownership: `StagingPool.lease()` hands a FREE buffer to one save as a `BufferLease`; the buffer stays
IN_FLIGHT until that lease ends, exactly once, whichever comes first: every persist task of the save has
finished (success or failure), the save failed before any task went out, an exception inside `with lease:`,
or the pool closing. A lease that ended cannot hand back a buffer a later save holds, and the pool never
frees a buffer a worker may still read. A buffer's CUDA pinning (`pinning`) is undone before its mapping
goes away (grown, closed).
"""

from __future__ import annotations

import contextlib
import enum
import mmap
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dcs_tasks.checkpoint.format.layout import Layout, staging_name_pattern
from dcs_tasks.checkpoint.save.copier import HostCopier
from dcs_tasks.checkpoint.save.pinning import HostPinner, Pin
from dcs_tasks.errors import StagingError
from dcs_tasks.process import pid_alive

_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
PAGE = mmap.PAGESIZE


class BufferState(str, enum.Enum):
    FREE = "free"
    IN_FLIGHT = "in_flight"


@dataclass
class StagingBuffer:
    """One staging file and its writable mapping. `view` is a uint8 tensor over the whole mapping."""

    path: Path
    capacity: int = 0
    state: BufferState = BufferState.FREE
    layout_signature: str | None = None
    _map: mmap.mmap | None = None
    view: torch.Tensor | None = None
    _pin: Pin | None = None  # the CUDA page-locking of the current mapping, if tried

    @property
    def pinned(self) -> bool:
        """Whether the current mapping is registered with CUDA as page-locked memory."""
        return self._pin is not None and self._pin.pinned

    def pin(self, pinner: HostPinner) -> bool:
        """Page-lock the current mapping (once per mapping; a refusal is logged and not retried)."""
        assert self.view is not None
        if self._pin is None:
            self._pin = Pin(self.view.data_ptr(), self.view.numel())
        return self._pin.register(pinner)

    def ensure(self, nbytes: int) -> None:
        """Make the buffer at least `nbytes` long, resident and mapped (no-op when it already is)."""
        if nbytes <= self.capacity and self.view is not None:
            return
        size = max(-(-nbytes // PAGE) * PAGE, PAGE)
        self._unmap()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:
                os.ftruncate(fd, size)
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                raise StagingError(f"cannot reserve {size} bytes of staging memory in {self.path}: {exc}") from exc
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        _prefault(self._map, size)
        self.view = torch.frombuffer(self._map, dtype=torch.uint8)
        self.capacity = size
        self.layout_signature = None

    def write_headers(self, layout: Layout) -> None:
        """Write the safetensors headers of `layout` (only when the buffer last held another layout)."""
        if self.layout_signature == layout.signature:
            return
        assert self.view is not None
        for f in layout.files:
            header = torch.frombuffer(bytearray(f.header), dtype=torch.uint8)
            self.view[f.offset : f.offset + len(f.header)].copy_(header)
        self.layout_signature = layout.signature

    def close(self) -> None:
        self._unmap()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def _unmap(self) -> None:
        if self._pin is not None:  # unpin while the memory is still mapped
            self._pin.unregister()
            self._pin = None
        self.view = None
        if self._map is not None:
            with contextlib.suppress(BufferError):
                self._map.close()
            self._map = None


def _prefault(mapping: mmap.mmap, size: int) -> None:
    """Map every page now, so the first save does not pay tmpfs page faults (~2 s/GiB)."""
    try:
        mapping.madvise(_MADV_POPULATE_WRITE)
    except (OSError, ValueError):
        view = torch.frombuffer(mapping, dtype=torch.uint8)
        view[::PAGE].zero_()
        del view


def remove_orphans(directory: Path, prefix: str) -> list[Path]:
    """Delete staging files of `prefix` left by trainer processes that no longer exist (crashed)."""
    removed = []
    ours = staging_name_pattern(prefix)
    for path in directory.glob(f"{prefix}-*.stage"):
        match = ours.fullmatch(path.name)
        if match and not pid_alive(int(match.group(1))):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed.append(path)
    return removed


class StagingPool:
    """`count` reusable staging buffers under `directory`; thread-safe acquire/release."""

    def __init__(self, directory: Path, count: int, prefix: str) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        remove_orphans(directory, prefix)
        token = uuid.uuid4().hex[:8]
        self._buffers = [StagingBuffer(directory / f"{prefix}-{os.getpid()}-{token}-{i}.stage") for i in range(count)]
        self._lock = threading.Lock()
        self._closed = False
        self._leases: dict[int, BufferLease] = {}  # id -> lease, while it holds its buffer

    @property
    def buffers(self) -> list[StagingBuffer]:
        return list(self._buffers)

    def reserve(self, nbytes: int) -> None:
        """Pre-allocate and pre-fault every free buffer to hold `nbytes` (a size hint)."""
        with self._lock:
            for buf in self._buffers:
                if buf.state is BufferState.FREE:
                    buf.ensure(nbytes)

    def lease(self, nbytes: int) -> BufferLease | None:
        """A free buffer of at least `nbytes`, held by the returned lease; None when every buffer is in flight."""
        with self._lock:
            if self._closed:
                raise StagingError("the staging pool is closed")
            free = [b for b in self._buffers if b.state is BufferState.FREE]
            if not free:
                return None
            buf = max(free, key=lambda b: (b.capacity >= nbytes, b.capacity))
            buf.state = BufferState.IN_FLIGHT
            lease = BufferLease(self, buf)
            self._leases[id(lease)] = lease
        with lease:  # a buffer that cannot grow goes straight back
            buf.ensure(nbytes)
        return lease

    def _end(self, lease: BufferLease) -> bool:
        """End `lease` (True) unless it already ended (False); its buffer is FREE again."""
        with self._lock:
            if self._leases.pop(id(lease), None) is None:
                return False
            lease.buffer.state = BufferState.FREE
            return True

    def mapped_bytes(self) -> int:
        """Bytes of staging memory this pool holds (the capacity of every buffer)."""
        with self._lock:
            return sum(b.capacity for b in self._buffers if not self._closed)

    def in_flight(self) -> int:
        with self._lock:
            return sum(b.state is BufferState.IN_FLIGHT for b in self._buffers)

    def unlink_free_files(self) -> None:
        """Delete the files of the buffers no save holds, taking no lock and unmapping nothing: the path of a
        process about to end by a signal (`exiting`), whose handler may run while this thread holds the lock.
        The mappings stay valid until the process ends; the files of buffers in flight stay for the workers."""
        for buf in list(self._buffers):
            if buf.state is BufferState.FREE:
                with contextlib.suppress(OSError):
                    buf.path.unlink()

    def close(self, keep_in_flight: bool = False) -> None:
        """End every lease, unmap every buffer and delete its file; with `keep_in_flight`, the files of buffers
        still leased stay (a worker has yet to read them; a later trainer of the run removes them once this
        one is dead). A lease's own `release()` after this is a no-op."""
        with self._lock:
            self._closed = True
            leased = {id(lease.buffer) for lease in self._leases.values()}
            self._leases.clear()
            for buf in self._buffers:
                if keep_in_flight and id(buf) in leased:
                    buf._unmap()
                else:
                    buf.close()
                buf.state = BufferState.FREE


class BufferLease:
    """One save's hold on a staging buffer, from `StagingPool.lease()` until it ends (`release()`).

    It ends exactly once: later `release()` calls, from any thread, do nothing, so a save that already gave
    its buffer back can never free it under the save that holds it now. `with lease:` ends it when the block
    raises (the save never got as far as handing the buffer to its persist tasks) and keeps it otherwise.
    """

    def __init__(self, pool: StagingPool, buffer: StagingBuffer) -> None:
        self._pool = pool
        self.buffer = buffer

    @property
    def released(self) -> bool:
        """True once the lease ended (its buffer handed back, or the pool closed)."""
        with self._pool._lock:
            return id(self) not in self._pool._leases

    def release(self) -> bool:
        """Hand the buffer back; True the first time, False when the lease had already ended."""
        return self._pool._end(self)

    def __enter__(self) -> BufferLease:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is not None:
            self.release()


@dataclass
class Reservation:
    """What `Checkpointer.reserve()` (or `size_hint_bytes`) took: staging for `nbytes` allocated and pre-faulted in
    `alloc_seconds`; where CUDA is used, each buffer registered as page-locked memory in `pin_seconds` (None until
    done, or when nothing was registered), `pinned` when every buffer was."""

    nbytes: int
    alloc_seconds: float
    pin_seconds: float | None = None
    pinned: bool = False
    _done: threading.Event = field(default_factory=threading.Event, repr=False)

    def register(self, pin: Callable[[StagingBuffer], bool], buffers: list[StagingBuffer]) -> None:
        started = time.perf_counter()
        try:
            self.pinned = all([pin(b) for b in buffers])
        finally:
            self.pin_seconds = time.perf_counter() - started
            self._done.set()

    @property
    def seconds(self) -> float:
        """Allocation plus registration (so far)."""
        return self.alloc_seconds + (self.pin_seconds or 0.0)

    def unregistered(self) -> None:
        """Nothing to register (no CUDA, or `pinned_memory` off): `wait()` returns at once."""
        self._done.set()

    def wait(self, timeout: float = 600.0) -> bool:
        """Block until the registration ended (True), at most `timeout` seconds; True at once when none runs."""
        return self._done.wait(timeout)


def _raw_bytes_are_values(src: torch.Tensor) -> bool:
    """True when `src`'s memory holds exactly its values in order: a contiguous CPU tensor without a lazy
    negation or conjugation bit (`c.conj().imag` is contiguous but its bytes are the un-negated values)."""
    return src.device.type == "cpu" and src.is_contiguous() and not src.is_neg() and not src.is_conj()


@torch.no_grad()
def copy_into(
    buf: StagingBuffer,
    layout: Layout,
    tensors: dict[str, torch.Tensor],
    non_blocking: bool = False,
    copier: HostCopier | None = None,
) -> None:
    """Copy every tensor into its slot of `buf` (headers must already be there). No allocation per tensor:
    contiguous CPU tensors are `memmove`d by `copier` (when given); the rest are `copy_`ed into dtype views
    over the mapping (`copy_` handles non-contiguous and device tensors)."""
    assert buf.view is not None
    view = buf.view
    base_ptr = view.data_ptr()
    jobs: list[tuple[int, int, int]] = []
    for f in layout.files:
        base = f.offset + f.data_start
        for slot in f.slots:
            if slot.end == slot.begin:
                continue
            src = tensors[slot.spec.name]
            if copier is not None and _raw_bytes_are_values(src):
                jobs.append((base_ptr + base + slot.begin, src.data_ptr(), slot.end - slot.begin))
                continue
            dst = view[base + slot.begin : base + slot.end].view(src.dtype).view(src.shape)
            dst.copy_(src, non_blocking=non_blocking)
    if jobs:
        assert copier is not None
        copier.copy(jobs)
