"""Restores into device (CUDA) tensors as a pipeline: bytes land in a small ring of reused page-locked host
chunks, each chunk goes to the device on a side stream while the next one is read and the last one hashed.

Why. Filling a CUDA target from a fresh host tensor is a pageable host-to-device copy per tensor (the driver
stages it through its own pinned bounce buffer and the call waits for it), after the whole step was read into
new host memory: the read, the copy and the hash run one after the other, and the copy runs at a fraction of the
link's speed. Here every byte crosses the link from page-locked memory, with no synchronisation per tensor.

The ring (`Ring`): `RING_SLOTS` page-locked buffers of `SLOT_BYTES` each (bounded memory, kept across restores).
A chunk of a file is read into a free slot (I/O threads: O_DIRECT or the page cache for files, ranged GETs for an
object store), then, in file order on the calling thread, its tensor pieces are queued as non-blocking copies on
the side stream of their device, an event is recorded after them, and the chunk is hashed while they run. A slot
is written again only after its events completed (`Slot.wait`). One synchronisation of the side streams at the
end; then each file's checksum is checked. A target that is not contiguous receives its bytes in a contiguous
device tensor first, copied into it on the side stream.

Sources (`restore_into_device`, the one entry for every restore whose `into=` holds device tensors):
- WHOLE (plain step, one trainer): the pipeline above, file by file, straight from storage (files or objects);
- a memory-tier step: its tmpfs files are mapped (`lend.map_many`: sealed files are not hashed again, others are
  hashed after mapping), each mapping is registered in place as page-locked memory (`HostPinner`, read-only)
  and copied from directly; a mapping the runtime refuses to register goes through the ring;
- RESHARD, RANGES (`sharding=`, DTensor targets, `strict=False`) and compressed files: the host path reads and
  verifies as on CPU, and every piece it would have `copy_`ed into a device target is queued through the ring
  instead (`Uploader.put`), so those restores share the no-pageable-copy, one-synchronisation path (their reads
  are not overlapped with the copies the way WHOLE's are).

If a file fails its checksum, CorruptCheckpoint is raised after the queued copies are finished: the targets then
hold a mix of that step's bytes and what they held before (restore falls back to an older step, which overwrites
every target; docs/checkpoints.md).

The seam (`save/devicecopy.py`'s `DeviceCopier`): streams, events, page-locked allocation, registration and the
copy. `CudaCopier` is the real one; a test passes a copier that runs the same pipeline on CPU tensors (and checks
its ordering).
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import threading
from collections import deque
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dcs_tasks.checkpoint.format.iosizes import DIRECT_ALIGN, O_DIRECT, O_NOFOLLOW, READ_THREADS
from dcs_tasks.checkpoint.format.layout import FileEntry, Manifest, new_hasher
from dcs_tasks.checkpoint.save.devicecopy import CudaCopier, DeviceCopier, Event
from dcs_tasks.checkpoint.save.pinning import Pin
from dcs_tasks.errors import CorruptCheckpoint
from dcs_tasks.storage import Location, store_of

SLOT_BYTES = 64 * 1024 * 1024  # one chunk of the ring: large enough for full-speed copies and reads
RING_SLOTS = 4  # chunks in flight (read, hashed, on the link): 256 MiB of page-locked memory in all
CACHED_ENOUGH = 0.5  # a file at least this much in the page cache is read buffered (as fileread does)


_default: list[DeviceCopier] = []


def default_copier() -> DeviceCopier:
    """The process's `CudaCopier` (made on first use)."""
    if not _default:
        _default.append(CudaCopier())
    return _default[0]


def device_targets(into: Any, copier: DeviceCopier) -> bool:
    """Whether `into` holds a tensor (a DTensor's local shard included) on a device `copier` fills."""
    if into is None:
        return False
    from dcs_tasks.checkpoint.state.structure import flatten_state

    return any(copier.on_device(t) for t in flatten_state(into).tensors.values())


# --- the ring ----------------------------------------------------------------------------------------------


@dataclass
class Slot:
    """One page-locked chunk of the ring and the events of the copies that read it last."""

    memory: torch.Tensor  # uint8, page-locked, DIRECT_ALIGN-aligned
    events: list[Event] = field(default_factory=list)

    def wait(self) -> None:
        """Block until every copy that reads this slot has run (then it may be written again)."""
        for event in self.events:
            event.synchronize()
        self.events.clear()


class Ring:
    """`count` reused page-locked slots of `nbytes` each (allocated on first use, kept by the restorer)."""

    def __init__(self, copier: DeviceCopier, count: int = RING_SLOTS, nbytes: int = SLOT_BYTES) -> None:
        self.copier, self.count, self.nbytes = copier, count, nbytes
        self._slots: list[Slot] = []
        self._next = 0

    def _make(self) -> Slot:
        raw = self.copier.pinned(self.nbytes + DIRECT_ALIGN)
        skip = -raw.data_ptr() % DIRECT_ALIGN
        return Slot(raw[skip : skip + self.nbytes])

    def take(self) -> Slot:
        """The next slot in turn, once the copies that read it are done."""
        if len(self._slots) < self.count:
            self._slots.append(self._make())
            return self._slots[-1]
        slot = self._slots[self._next]
        self._next = (self._next + 1) % self.count
        slot.wait()
        return slot

    def drain(self) -> None:
        for slot in self._slots:
            slot.wait()


class Uploader:
    """Queues host bytes into device tensors through the ring; `finish()` is the one synchronisation."""

    def __init__(self, copier: DeviceCopier, ring: Ring) -> None:
        self.copier, self.ring = copier, ring
        self._streams: dict[torch.device, Any] = {}

    def stream(self, device: torch.device) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = self.copier.stream(device)
        return stream

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Event:
        """Queue `dst.copy_(src)` on `dst`'s side stream (src page-locked); the event of the copy."""
        stream = self.stream(dst.device)
        self.copier.copy(dst, src, stream)
        return self.copier.record(stream)

    def put(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """`dst.copy_(src)` for a device `dst` and a host `src` of the same shape and dtype (any strides): `src`'s
        bytes go through ring slots, `dst` receives them on its side stream. A host `dst` is copied into here."""
        if src.numel() == 0:
            return
        if not self.copier.on_device(dst):
            with torch.no_grad():
                dst.copy_(src)
            return
        host = src.detach().contiguous()
        if dst.is_contiguous():
            self._bytes(_flat_bytes(dst), _flat_bytes(host))
            return
        with torch.no_grad():
            twin = self.copier.empty(dst)
            self._bytes(_flat_bytes(twin), _flat_bytes(host))
            self.copier.copy(dst, twin, self.stream(dst.device))

    def _bytes(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        for pos in range(0, src.numel(), self.ring.nbytes):
            n = min(self.ring.nbytes, src.numel() - pos)
            slot = self.ring.take()
            slot.memory[:n].copy_(src[pos : pos + n])
            slot.events.append(self.copy(dst[pos : pos + n], slot.memory[:n]))

    def finish(self) -> None:
        """Wait for every queued copy (the one synchronisation of the restore)."""
        for stream in self._streams.values():
            self.copier.synchronize(stream)
        self.ring.drain()


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


# --- WHOLE: files or objects straight through the ring ---------------------------------------------------------


@dataclass
class _Dest:
    """Where one tensor's bytes [begin, end) of its file go: `bytes_` (contiguous device bytes) and, when the
    target is not contiguous, the target that receives `bytes_`' tensor once its last byte is queued."""

    begin: int
    end: int
    bytes_: torch.Tensor
    twin: torch.Tensor | None = None
    target: torch.Tensor | None = None
    host: bool = False  # a host target of a mixed state: copied at once, not queued


class _Source:
    """One file or object, read chunk by chunk into slots."""

    def __init__(self, path: Location, entry: FileEntry, verify: bool, dests: list[_Dest]) -> None:
        self.path, self.entry, self.dests = path, entry, sorted(dests, key=lambda d: d.begin)
        self.hasher = new_hasher() if verify else None
        self.local = store_of(path).local_path(path)
        self.fd = self.direct_fd = -1
        self._lock = threading.Lock()

    def open(self) -> None:
        if self.local is None:
            return
        from dcs_tasks.checkpoint.store.reads.fileread import cached_fraction

        try:
            self.fd = os.open(self.local, os.O_RDONLY | O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as exc:
            reason = f"checkpoint file {self.path} cannot be opened: {exc.strerror}"
            raise CorruptCheckpoint(reason, str(self.path)) from exc
        if os.fstat(self.fd).st_size != self.entry.size:
            raise CorruptCheckpoint(f"checkpoint file {self.path} changed while being opened", str(self.path))
        if O_DIRECT and cached_fraction(self.fd, self.entry.size) < CACHED_ENOUGH:
            try:
                self.direct_fd = os.open(self.local, os.O_RDONLY | O_DIRECT | O_NOFOLLOW | os.O_NONBLOCK)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise

    def close(self) -> None:
        for fd in {self.fd, self.direct_fd}:
            if fd >= 0:
                os.close(fd)
        self.fd = self.direct_fd = -1

    def read(self, memory: torch.Tensor, begin: int, end: int) -> None:
        """Fill memory[: end - begin] with the bytes [begin, end) (memory is aligned and a slot long)."""
        view = memory.numpy().data
        if self.local is None:
            store_of(self.path).read_into(self.path, begin, [view[: end - begin]])
            return
        done, want = 0, end - begin
        while done < want:
            with self._lock:
                fd = self.direct_fd
            direct = fd >= 0 and done % DIRECT_ALIGN == 0
            room = min(len(view), -(-want // DIRECT_ALIGN) * DIRECT_ALIGN) - done if direct else want - done
            try:
                n = os.preadv(fd if direct else self.fd, [view[done : done + room]], begin + done)
            except OSError as exc:
                if not (direct and exc.errno == errno.EINVAL):
                    raise
                with self._lock:
                    self.direct_fd = -1  # this file system refuses the alignment: buffered from here on
                continue
            if n <= 0:
                reason = f"checkpoint file {self.path} ended early at byte {begin + done}"
                raise CorruptCheckpoint(reason, str(self.path))
            done += n

    def overlapping(self, begin: int, end: int) -> Iterator[_Dest]:
        for dest in self.dests:
            if dest.begin >= end:
                return
            if dest.end > begin:
                yield dest

    def finish(self) -> None:
        if self.hasher is not None and self.hasher.hexdigest() != self.entry.checksum:
            raise CorruptCheckpoint(
                f"checkpoint file {self.path} fails its {self.entry.algorithm} checksum", str(self.path)
            )


def _dests(manifest: Manifest, targets: Mapping[str, torch.Tensor], copier: DeviceCopier) -> dict[str, list[_Dest]]:
    by_file: dict[str, list[_Dest]] = {f.name: [] for f in manifest.files}
    for name, entry in manifest.tensors.items():
        begin, end = entry.offsets
        if end <= begin:
            continue
        target = targets[name]
        if not copier.on_device(target) and target.is_contiguous():
            by_file[entry.file].append(_Dest(begin, end, _flat_bytes(target), host=True))
        elif not copier.on_device(target):  # a strided host target: filled from a host twin once complete
            twin = torch.empty(target.shape, dtype=target.dtype)
            by_file[entry.file].append(_Dest(begin, end, _flat_bytes(twin), twin, target, host=True))
        elif target.is_contiguous():
            by_file[entry.file].append(_Dest(begin, end, _flat_bytes(target)))
        else:
            twin = copier.empty(target)
            by_file[entry.file].append(_Dest(begin, end, _flat_bytes(twin), twin, target))
    return by_file


def _stream_files(sources: list[_Source], uploader: Uploader) -> None:
    """Read every chunk of `sources` into ring slots (I/O threads, `ring.count` chunks ahead at most), and in
    file order queue its pieces to the device, then hash it while the copies run."""
    ring = uploader.ring
    chunks = [(s, b, min(b + ring.nbytes, s.entry.size)) for s in sources for b in range(0, s.entry.size, ring.nbytes)]
    with ThreadPoolExecutor(min(READ_THREADS, ring.count), thread_name_prefix="dcs-devread") as pool:
        window: deque[tuple[_Source, int, int, Slot, Future[None]]] = deque()
        pending = iter(chunks)
        try:
            for source, begin, end in pending:
                if len(window) >= ring.count:
                    _land(*window.popleft(), uploader)
                slot = ring.take()  # waits for the copies that last read it
                window.append((source, begin, end, slot, pool.submit(source.read, slot.memory, begin, end)))
            while window:
                _land(*window.popleft(), uploader)
        finally:
            for *_, future in window:
                future.cancel()
            for *_, future in window:
                if not future.cancelled():
                    future.exception()  # nothing still writes a slot when this returns


def _land(
    source: _Source,
    begin: int,
    end: int,
    slot: Slot,
    future: Future[None],
    uploader: Uploader,
) -> None:
    future.result()
    for dest in source.overlapping(begin, end):
        lo, hi = max(begin, dest.begin), min(end, dest.end)
        dst, src = dest.bytes_[lo - dest.begin : hi - dest.begin], slot.memory[lo - begin : hi - begin]
        if dest.host:
            with torch.no_grad():
                dst.copy_(src)
                if hi == dest.end and dest.target is not None and dest.twin is not None:
                    dest.target.copy_(dest.twin)
            continue
        slot.events.append(uploader.copy(dst, src))
        if hi == dest.end and dest.target is not None and dest.twin is not None:
            uploader.copier.copy(dest.target, dest.twin, uploader.stream(dest.target.device))
    if source.hasher is not None:
        source.hasher.update(slot.memory[: end - begin].numpy().data)


def load_whole(
    step_dir: Location,
    manifest: Manifest,
    targets: Mapping[str, torch.Tensor],
    verify: bool,
    uploader: Uploader,
) -> None:
    """Every file of a plain step (checked with `check_files`, targets with `check_targets` by the caller)
    through the ring into `targets`. Compressed files go through the host path (`put`)."""
    if any(f.compression for f in manifest.files):
        from dcs_tasks.checkpoint.restore import reader

        host = reader.load_tensors(step_dir, manifest, verify=verify)
        put_all(uploader, targets, host)
        return
    by_file = _dests(manifest, targets, uploader.copier)
    sources = [_Source(f.stored_path(step_dir), f, verify, by_file[f.name]) for f in manifest.files]
    try:
        for source in sources:
            source.open()
        try:
            _stream_files(sources, uploader)
        finally:
            uploader.finish()  # nothing reads a slot, nothing writes a target, when this returns or raises
        for source in sources:
            source.finish()
    finally:
        for source in sources:
            source.close()


def put_all(uploader: Uploader, targets: Mapping[str, torch.Tensor], host: Mapping[str, torch.Tensor]) -> None:
    try:
        for name, target in targets.items():
            uploader.put(target, host[name])
    finally:
        uploader.finish()


# --- a memory-tier step: its mappings registered in place --------------------------------------------------------


def load_mapped(
    step_dir: Path,
    manifest: Manifest,
    targets: Mapping[str, torch.Tensor],
    verify: bool,
    seals: Mapping[str, Any],
    uploader: Uploader,
) -> None:
    """A memory-tier step: each file mapped (`lend.map_many`: sealed files not hashed again, others hashed after
    mapping), registered in place as page-locked memory and copied from directly; a mapping that cannot be
    registered goes through the ring. Unmappable files: the caller reads the step from its files."""
    from dcs_tasks.checkpoint.restore.lend import map_many

    files = [(f.stored_path(step_dir), f) for f in manifest.files]
    mappings = map_many(files, verify, seals)
    pins: list[Pin] = []
    try:
        for f, mapping in zip(manifest.files, mappings, strict=True):
            if not f.size:
                continue
            pin = Pin(_address(mapping), f.size)
            pinned = pin.register(uploader.copier.pinner)  # False: refused, logged; this file goes through the ring
            if pinned:
                pins.append(pin)
            _queue_mapped(mapping, manifest, f.name, targets, pinned, uploader)
    finally:
        uploader.finish()  # nothing reads a mapping once this returns
        for pin in pins:
            pin.unregister()
        for mapping in mappings:
            with contextlib.suppress(BufferError):  # a view still held elsewhere: closed when it goes
                mapping.close()


def _queue_mapped(
    mapping: mmap.mmap,
    manifest: Manifest,
    file: str,
    targets: Mapping[str, torch.Tensor],
    pinned: bool,
    uploader: Uploader,
) -> None:
    """Queue the tensors of one mapped file into their targets: straight from the mapping when it is registered
    and the target contiguous, else through the ring."""
    from dcs_tasks.checkpoint.restore.tensorviews import tensors_over

    host = tensors_over(mapping, {n: e for n, e in manifest.tensors.items() if e.file == file})
    for name, tensor in host.items():
        target = targets[name]
        if tensor.numel() == 0:
            continue
        if pinned and uploader.copier.on_device(target) and target.is_contiguous():
            uploader.copy(target, tensor)
        else:
            uploader.put(target, tensor)


def _address(mapping: mmap.mmap) -> int:
    import ctypes

    anchor = ctypes.c_char.from_buffer(mapping)
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor


# --- the one entry -------------------------------------------------------------------------------------------


class DeviceRestorer:
    """Every restore into device targets of one checkpointer: its copier and its ring (kept across restores)."""

    def __init__(self, copier: DeviceCopier | None = None, slots: int = RING_SLOTS, slot_bytes: int = SLOT_BYTES):
        self._copier = copier
        self._slots, self._slot_bytes = slots, slot_bytes
        self._ring: Ring | None = None

    @property
    def copier(self) -> DeviceCopier:
        if self._copier is None:
            self._copier = default_copier()
        return self._copier

    def wants(self, into: Any) -> bool:
        """Whether a restore into `into` takes this path (it holds a device tensor)."""
        if into is None:
            return False
        if self._copier is None and not torch.cuda.is_available():
            return False
        return device_targets(into, self.copier)

    def uploader(self) -> Uploader:
        if self._ring is None:
            self._ring = Ring(self.copier, self._slots, self._slot_bytes)
        return Uploader(self.copier, self._ring)
