"""DCS's colocated-update frame: one bucket shared by handle, described by a JSON header with fixed fields.

A colocated trainer (same host, same device as the engine) does not send a bucket's bytes: it packs the bucket
into shared memory it owns and sends the receiver a frame naming that memory. The frame is JSON, never pickle,
and its fields are fixed (an unknown or missing field is refused, `IpcFrameInvalid`):

| field | meaning |
| --- | --- |
| `format`, `v` | `"dcs-ipc-frame"`, 1 |
| `kind` | `"shm"` (a CPU bucket in a file under /dev/shm) or `"cuda"` (a CUDA IPC memory handle) |
| `bucket`, `generation` | the trainer's bucket slot and how often that slot was reallocated (for its bookkeeping) |
| `nbytes` | the bucket's bytes as laid out (SGLang's flattened layout of `names`/`dtypes`/`shapes`) |
| `names`, `dtypes`, `shapes` | the bucket's tensors, in SGLang's order (largest itemsize first, no padding) |
| `shm` | kind shm: `{"name": "/torch_<pid>_<n>_<n>", "offset": 64}` (torch's shared file and its header size) |
| `cuda` | kind cuda: torch's `_share_cuda_` fields (`device`, `handle`, `storage_bytes`, `storage_offset`, |
| | `ref_counter`, `ref_counter_offset`, `event`; bytes as hex) |
| `weight_version`, `last` | the update's version and whether this is its last bucket (the receiver commits then) |

What a receiver trusts: nothing beyond what it checks. A shm name must match torch's spelling (no `/` after
the first, no `..`), the file must be a regular file under /dev/shm opened without following links, and the
bucket must lie inside it; it is mapped read-only and copied out before the answer. The trainer never reads a
handle back: an engine's answer releases a bucket by answering, and nothing an engine sends is used as an
address in the trainer's memory. Sizes are bounded (`MAX_FRAME_BYTES`, `MAX_TENSORS`, `MAX_BUCKET_BYTES`).
"""

from __future__ import annotations

import json
import mmap
import os
import re
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from dcs_tasks.backends.fusion import SGLANG_ALIGNMENT, FusionLayout
from dcs_tasks.errors import WeightSyncError

FORMAT = "dcs-ipc-frame"
VERSION = 1
MAX_FRAME_BYTES = 8 * 1024 * 1024  # a header: names, dtypes, shapes of one bucket
MAX_TENSORS = 65536
MAX_BUCKET_BYTES = 64 * 1024**3
SHM_DIR = "/dev/shm"
SHM_NAME = re.compile(r"^/torch_[0-9]{1,10}_[0-9]{1,20}_[0-9]{1,20}$")  # torch's file_system sharing names
HEX = re.compile(r"^[0-9a-f]{0,1024}$")
_TOP = {"format", "v", "kind", "bucket", "generation", "nbytes", "names", "dtypes", "shapes", "shm", "cuda"}
_TOP |= {"weight_version", "last"}
_SHM = {"name", "offset"}
_CUDA = {"device", "handle", "storage_bytes", "storage_offset", "ref_counter", "ref_counter_offset", "event"}


class IpcFrameInvalid(WeightSyncError, ValueError):
    """A colocated-update frame that is not what DCS defines (a field missing, unknown, of the wrong type or out
    of bounds), or whose memory cannot be opened as described."""


@dataclass(frozen=True)
class ShmRef:
    name: str
    offset: int


@dataclass(frozen=True)
class CudaRef:
    device: int
    handle: bytes
    storage_bytes: int
    storage_offset: int
    ref_counter: bytes
    ref_counter_offset: int
    event: bytes


@dataclass(frozen=True)
class IpcFrame:
    """One bucket by handle (see the module's table)."""

    kind: str
    bucket: int
    generation: int
    nbytes: int
    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    weight_version: int
    last: bool
    shm: ShmRef | None = None
    cuda: CudaRef | None = None

    def layout(self) -> FusionLayout:
        """The bucket's layout (SGLang's flattened one); IpcFrameInvalid if it disagrees with `nbytes`."""
        try:
            layout = FusionLayout.from_wire(self.names, self.dtypes, self.shapes, SGLANG_ALIGNMENT)
        except ValueError as exc:  # InvalidTensorSpec / UnsupportedDtype are ValueErrors
            raise IpcFrameInvalid(f"frame tensors: {exc}") from None
        if layout.wire_bytes != self.nbytes:
            raise IpcFrameInvalid(f"frame says nbytes={self.nbytes}, its tensors take {layout.wire_bytes}")
        return layout

    def encode(self) -> bytes:
        body: dict[str, Any] = {
            "format": FORMAT,
            "v": VERSION,
            "kind": self.kind,
            "bucket": self.bucket,
            "generation": self.generation,
            "nbytes": self.nbytes,
            "names": list(self.names),
            "dtypes": list(self.dtypes),
            "shapes": [list(s) for s in self.shapes],
            "weight_version": self.weight_version,
            "last": self.last,
            "shm": None if self.shm is None else {"name": self.shm.name, "offset": self.shm.offset},
            "cuda": None,
        }
        if self.cuda is not None:
            c = self.cuda
            body["cuda"] = {
                "device": c.device,
                "handle": c.handle.hex(),
                "storage_bytes": c.storage_bytes,
                "storage_offset": c.storage_offset,
                "ref_counter": c.ref_counter.hex(),
                "ref_counter_offset": c.ref_counter_offset,
                "event": c.event.hex(),
            }
        return json.dumps(body, separators=(",", ":")).encode()


def _int(body: dict[str, Any], key: str, low: int, high: int) -> int:
    value = body.get(key)
    if type(value) is not int or not low <= value <= high:
        raise IpcFrameInvalid(f"frame field {key!r} must be an integer in [{low}, {high}], got {value!r}")
    return value


def _fields(body: Any, expected: set[str], where: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise IpcFrameInvalid(f"{where} must be a JSON object")
    if set(body) != expected:
        missing, unknown = sorted(expected - set(body)), sorted(set(body) - expected)
        raise IpcFrameInvalid(f"{where}: missing fields {missing}, unknown fields {unknown}")
    return body


def _hex(body: dict[str, Any], key: str) -> bytes:
    value = body.get(key)
    if not isinstance(value, str) or not HEX.match(value) or len(value) % 2:
        raise IpcFrameInvalid(f"frame field cuda.{key} must be hex bytes (at most 512), got {value!r:.80}")
    return bytes.fromhex(value)


def _strings(body: dict[str, Any], key: str) -> tuple[str, ...]:
    value = body.get(key)
    if not isinstance(value, list) or not all(isinstance(v, str) and 0 < len(v) <= 1024 for v in value):
        raise IpcFrameInvalid(f"frame field {key!r} must be a list of non-empty strings of <= 1024 characters")
    return tuple(value)


def decode(raw: bytes | str) -> IpcFrame:
    """Parse and check a frame; IpcFrameInvalid naming the first thing that is wrong."""
    if len(raw) > MAX_FRAME_BYTES:
        raise IpcFrameInvalid(f"frame of {len(raw)} bytes is over {MAX_FRAME_BYTES}")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise IpcFrameInvalid(f"frame is not JSON: {exc}") from None
    return from_json(body)


def from_json(body: Any) -> IpcFrame:
    """A frame from its parsed JSON object (what `decode` checks after parsing)."""
    body = _fields(body, _TOP, "frame")
    if body["format"] != FORMAT or body["v"] != VERSION:
        raise IpcFrameInvalid(f"frame format {body['format']!r} v{body['v']!r}: this receiver reads {FORMAT} v1")
    kind = body["kind"]
    if kind not in ("shm", "cuda"):
        raise IpcFrameInvalid(f"frame kind must be 'shm' or 'cuda', got {kind!r}")
    names, dtypes = _strings(body, "names"), _strings(body, "dtypes")
    shapes_raw = body["shapes"]
    if not isinstance(shapes_raw, list) or not all(
        isinstance(s, list) and len(s) <= 16 and all(type(d) is int and 0 <= d < 2**48 for d in s) for s in shapes_raw
    ):
        raise IpcFrameInvalid("frame field 'shapes' must be a list of lists of <= 16 non-negative integers")
    if not 0 < len(names) <= MAX_TENSORS or not len(names) == len(dtypes) == len(shapes_raw):
        raise IpcFrameInvalid(
            f"frame names/dtypes/shapes must have the same length in [1, {MAX_TENSORS}], got "
            f"{len(names)}/{len(dtypes)}/{len(shapes_raw)}"
        )
    if type(body["last"]) is not bool:
        raise IpcFrameInvalid(f"frame field 'last' must be a boolean, got {body['last']!r}")
    shm = cuda = None
    if kind == "shm":
        if body["cuda"] is not None:
            raise IpcFrameInvalid("a shm frame has cuda: null")
        s = _fields(body["shm"], _SHM, "frame field 'shm'")
        if not isinstance(s["name"], str) or not SHM_NAME.match(s["name"]):
            raise IpcFrameInvalid(f"frame shm.name {s['name']!r:.80} is not a torch shared-memory file name")
        shm = ShmRef(s["name"], _int(s, "offset", 0, 4096))
    else:
        if body["shm"] is not None:
            raise IpcFrameInvalid("a cuda frame has shm: null")
        c = _fields(body["cuda"], _CUDA, "frame field 'cuda'")
        cuda = CudaRef(
            _int(c, "device", 0, 1023),
            _hex(c, "handle"),
            _int(c, "storage_bytes", 0, MAX_BUCKET_BYTES),
            _int(c, "storage_offset", 0, MAX_BUCKET_BYTES),
            _hex(c, "ref_counter"),
            _int(c, "ref_counter_offset", 0, 2**32),
            _hex(c, "event"),
        )
    frame = IpcFrame(
        kind,
        _int(body, "bucket", 0, 1023),
        _int(body, "generation", 0, 2**62),
        _int(body, "nbytes", 1, MAX_BUCKET_BYTES),
        names,
        dtypes,
        tuple(tuple(s) for s in shapes_raw),
        _int(body, "weight_version", 1, 2**62),
        body["last"],
        shm,
        cuda,
    )
    frame.layout()  # tensors must fill exactly nbytes
    return frame


@contextmanager
def open_bucket(frame: IpcFrame) -> Iterator[torch.Tensor]:
    """The bucket a frame names, as a read-only-in-spirit uint8 tensor of `frame.nbytes` valid inside the block
    (copy what you keep). shm: the file mapped read-only; cuda: the trainer's memory opened by its IPC handle."""
    if frame.kind == "shm":
        assert frame.shm is not None
        with _open_shm(frame.shm, frame.nbytes) as view:
            yield view
    else:
        assert frame.cuda is not None
        yield _open_cuda(frame.cuda, frame.nbytes)


@contextmanager
def _open_shm(ref: ShmRef, nbytes: int) -> Iterator[torch.Tensor]:
    path = SHM_DIR + ref.name
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise IpcFrameInvalid(f"frame's shared memory {path} cannot be opened: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size < ref.offset + nbytes:
            raise IpcFrameInvalid(
                f"frame's shared memory {path} holds {info.st_size} bytes, the bucket needs {ref.offset + nbytes}"
            )
        mapped = mmap.mmap(fd, ref.offset + nbytes, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    try:
        # torch wants a writable buffer; the mapping is PROT_READ, so a write would fault, never reach the file
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            view = torch.frombuffer(mapped, dtype=torch.uint8, count=nbytes, offset=ref.offset)
        yield view
        del view
    finally:
        try:
            mapped.close()
        except BufferError:  # a view escaped the block: the mapping goes when it does
            pass


def _open_cuda(ref: CudaRef, nbytes: int) -> torch.Tensor:
    if not torch.cuda.is_available():
        raise IpcFrameInvalid("a cuda frame reached a receiver without CUDA")
    if nbytes > ref.storage_bytes:
        raise IpcFrameInvalid(f"cuda frame: a bucket of {nbytes} bytes in a storage of {ref.storage_bytes}")
    # torch's own rebuild (torch.multiprocessing.reductions.rebuild_cuda_tensor) with the frame's fields: the
    # storage starts `storage_offset` bytes into the trainer's IPC block; the bucket is the storage's start
    storage = torch.UntypedStorage._new_shared_cuda(
        ref.device,
        ref.handle,
        ref.storage_bytes,
        ref.storage_offset,
        ref.ref_counter,
        ref.ref_counter_offset,
        ref.event,
        True,
    )
    whole = torch.empty(0, dtype=torch.uint8, device=f"cuda:{ref.device}")
    whole.set_(storage, 0, (ref.storage_bytes,), (1,))
    return whole[:nbytes]


def frame_for(
    kind: str,
    bucket: int,
    generation: int,
    layout: FusionLayout,
    weight_version: int,
    last: bool,
    shm: ShmRef | None = None,
    cuda: CudaRef | None = None,
) -> IpcFrame:
    """The frame of one packed bucket (the trainer's side)."""
    return IpcFrame(
        kind,
        bucket,
        generation,
        layout.wire_bytes,
        tuple(s.name for s in layout.specs),
        tuple(s.dtype_name for s in layout.specs),
        tuple(tuple(s.shape) for s in layout.specs),
        weight_version,
        last,
        shm,
        cuda,
    )
