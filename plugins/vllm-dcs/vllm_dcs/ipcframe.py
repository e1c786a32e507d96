"""DCS's colocated-update frame, as the plugin reads it: JSON with fixed fields, never pickle.

The same format and bounds as DCS's own reader (dcs_tasks/sync/ipcframe.py in the DCS repository; this plugin
has no DCS runtime dependency, so it carries its own reader). One frame names one bucket of the trainer's memory:

| field | meaning |
| --- | --- |
| `format`, `v` | `"dcs-ipc-frame"`, 1 |
| `kind` | `"shm"` (a CPU bucket in torch's shared-memory file under /dev/shm) or `"cuda"` (a CUDA IPC handle) |
| `bucket`, `generation` | the trainer's bucket slot and its reallocation count (the trainer's bookkeeping) |
| `nbytes` | the bucket's bytes: `names`/`dtypes`/`shapes` back to back, each offset a multiple of its itemsize |
| `shm` | kind shm: `{"name": "/torch_<pid>_<n>_<n>", "offset": 64}` |
| `cuda` | kind cuda: torch's `_share_cuda_` fields (`device`, `handle`, `storage_bytes`, `storage_offset`, |
| | `ref_counter`, `ref_counter_offset`, `event`; bytes as hex) |
| `weight_version`, `last` | the update's version and whether this is its last bucket |

Anything missing, unknown, of the wrong type or out of bounds raises `FrameInvalid` (a ValueError, which vLLM's
worker reports as the update's failure). A shm file is opened without following links, must be a regular file
holding the bucket, and is mapped read-only; a CUDA block is opened with torch's own IPC rebuild from the
checked fields. The caller copies what it keeps before the block ends.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import re
import stat
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

FORMAT = "dcs-ipc-frame"
VERSION = 1
MAX_FRAME_BYTES = 8 * 1024 * 1024
MAX_TENSORS = 65536
MAX_BUCKET_BYTES = 64 * 1024**3
SHM_DIR = "/dev/shm"
SHM_NAME = re.compile(r"^/torch_[0-9]{1,10}_[0-9]{1,20}_[0-9]{1,20}$")
HEX = re.compile(r"^[0-9a-f]{0,1024}$")
DTYPE_NAME = re.compile(r"^[a-z0-9_]{1,32}$")
_TOP = {"format", "v", "kind", "bucket", "generation", "nbytes", "names", "dtypes", "shapes", "shm", "cuda"}
_TOP |= {"weight_version", "last"}
_SHM = {"name", "offset"}
_CUDA = {"device", "handle", "storage_bytes", "storage_offset", "ref_counter", "ref_counter_offset", "event"}


class FrameInvalid(ValueError):
    """A frame that is not DCS's colocated-update frame, or whose memory cannot be opened as it says."""


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
class Frame:
    kind: str
    nbytes: int
    names: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    weight_version: int
    last: bool
    shm_name: str | None = None
    shm_offset: int = 0
    cuda: CudaRef | None = None


def _int(body: dict[str, Any], key: str, low: int, high: int) -> int:
    value = body.get(key)
    if type(value) is not int or not low <= value <= high:
        raise FrameInvalid(f"frame field {key!r} must be an integer in [{low}, {high}], got {value!r:.40}")
    return value


def _fields(body: Any, expected: set[str], where: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise FrameInvalid(f"{where} must be a JSON object")
    if set(body) != expected:
        missing, unknown = sorted(expected - set(body)), sorted(map(str, set(body) - expected))
        raise FrameInvalid(f"{where}: missing fields {missing}, unknown fields {unknown}"[:400])
    return body


def _hex(body: dict[str, Any], key: str) -> bytes:
    value = body.get(key)
    if not isinstance(value, str) or not HEX.match(value) or len(value) % 2:
        raise FrameInvalid(f"frame field cuda.{key} must be hex bytes (at most 512)")
    return bytes.fromhex(value)


def _strings(body: dict[str, Any], key: str) -> tuple[str, ...]:
    value = body.get(key)
    if not isinstance(value, list) or not all(isinstance(v, str) and 0 < len(v) <= 1024 for v in value):
        raise FrameInvalid(f"frame field {key!r} must be a list of non-empty strings of <= 1024 characters")
    return tuple(value)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if DTYPE_NAME.match(name) else None
    if not isinstance(dtype, torch.dtype):
        raise FrameInvalid(f"frame dtype {name!r:.40} is not a torch dtype")
    return dtype


def decode(raw: bytes | str) -> Frame:
    """Parse and check a frame's JSON text; FrameInvalid naming the first thing that is wrong."""
    if len(raw) > MAX_FRAME_BYTES:
        raise FrameInvalid(f"frame of {len(raw)} bytes is over {MAX_FRAME_BYTES}")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise FrameInvalid(f"frame is not JSON: {exc}") from None
    return from_json(body)


def from_json(body: Any) -> Frame:
    """A frame from its parsed JSON object (vLLM hands the worker the update's JSON already parsed)."""
    body = _fields(body, _TOP, "frame")
    if body["format"] != FORMAT or body["v"] != VERSION:
        raise FrameInvalid(f"frame format {body['format']!r:.40} v{body['v']!r:.10}: this plugin reads {FORMAT} v1")
    kind = body["kind"]
    if kind not in ("shm", "cuda"):
        raise FrameInvalid(f"frame kind must be 'shm' or 'cuda', got {kind!r:.40}")
    names = _strings(body, "names")
    dtypes = tuple(_dtype(d) for d in _strings(body, "dtypes"))
    shapes_raw = body["shapes"]
    if not isinstance(shapes_raw, list) or not all(
        isinstance(s, list) and len(s) <= 16 and all(type(d) is int and 0 <= d < 2**48 for d in s) for s in shapes_raw
    ):
        raise FrameInvalid("frame field 'shapes' must be a list of lists of <= 16 non-negative integers")
    if not 0 < len(names) <= MAX_TENSORS or not len(names) == len(dtypes) == len(shapes_raw):
        raise FrameInvalid(
            f"frame names/dtypes/shapes must have the same length in [1, {MAX_TENSORS}], got "
            f"{len(names)}/{len(dtypes)}/{len(shapes_raw)}"
        )
    if type(body["last"]) is not bool:
        raise FrameInvalid("frame field 'last' must be a boolean")
    _int(body, "bucket", 0, 1023)
    _int(body, "generation", 0, 2**62)
    nbytes = _int(body, "nbytes", 1, MAX_BUCKET_BYTES)
    shapes = tuple(tuple(s) for s in shapes_raw)
    offsets = _offsets(names, dtypes, shapes, nbytes)
    shm_name, shm_offset, cuda = _memory(body, kind)
    return Frame(
        kind,
        nbytes,
        names,
        dtypes,
        shapes,
        offsets,
        _int(body, "weight_version", 1, 2**62),
        body["last"],
        shm_name,
        shm_offset,
        cuda,
    )


def _offsets(
    names: tuple[str, ...], dtypes: tuple[torch.dtype, ...], shapes: tuple[tuple[int, ...], ...], nbytes: int
) -> tuple[int, ...]:
    """Each tensor's byte offset: back to back, each a multiple of its itemsize, together exactly `nbytes`."""
    offsets, at = [], 0
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        if at % dtype.itemsize:
            raise FrameInvalid(f"frame tensor {name!r:.80} at byte {at} is not aligned to its {dtype}")
        offsets.append(at)
        at += math.prod(shape) * dtype.itemsize
        if at > nbytes:
            break
    if at != nbytes:
        raise FrameInvalid(f"frame says nbytes={nbytes}, its tensors take {at if at <= nbytes else 'more'}")
    return tuple(offsets)


def _memory(body: dict[str, Any], kind: str) -> tuple[str | None, int, CudaRef | None]:
    """The frame's shm (name, offset) or its CUDA fields, whichever `kind` says; the other must be null."""
    if kind == "shm":
        if body["cuda"] is not None:
            raise FrameInvalid("a shm frame has cuda: null")
        s = _fields(body["shm"], _SHM, "frame field 'shm'")
        if not isinstance(s["name"], str) or not SHM_NAME.match(s["name"]):
            raise FrameInvalid(f"frame shm.name {s['name']!r:.80} is not a torch shared-memory file name")
        return s["name"], _int(s, "offset", 0, 4096), None
    if body["shm"] is not None:
        raise FrameInvalid("a cuda frame has shm: null")
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
    return None, 0, cuda


@contextmanager
def open_bucket(frame: Frame, device: torch.device) -> Iterator[torch.Tensor]:
    """The bucket as a uint8 tensor of `frame.nbytes`, valid inside the block (copy what you keep): shm, the file
    mapped read-only; cuda, the trainer's block opened by its IPC handle on `device`, the worker's own device
    (as vLLM's `ipc` engine rebuilds on the receiver's index: the trainer may number the same GPU otherwise)."""
    if frame.kind == "shm":
        with _open_shm(frame) as view:
            yield view
        return
    assert frame.cuda is not None
    if device.type != "cuda" or not torch.cuda.is_available():
        raise FrameInvalid(f"a cuda frame reached a worker on {device}")
    index = device.index if device.index is not None else torch.cuda.current_device()
    view = _open_cuda(frame.cuda, frame.nbytes, index)
    try:
        yield view
    finally:
        del view


@contextmanager
def _open_shm(frame: Frame) -> Iterator[torch.Tensor]:
    assert frame.shm_name is not None
    path = SHM_DIR + frame.shm_name
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise FrameInvalid(f"frame's shared memory {path} cannot be opened: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        need = frame.shm_offset + frame.nbytes
        if not stat.S_ISREG(info.st_mode) or info.st_size < need:
            raise FrameInvalid(f"frame's shared memory {path} holds {info.st_size} bytes, the bucket needs {need}")
        mapped = mmap.mmap(fd, need, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    try:
        with warnings.catch_warnings():  # torch wants a writable buffer; a write to PROT_READ faults
            warnings.simplefilter("ignore", UserWarning)
            view = torch.frombuffer(mapped, dtype=torch.uint8, count=frame.nbytes, offset=frame.shm_offset)
        yield view
        del view
    finally:
        try:
            mapped.close()
        except BufferError:
            pass


def _open_cuda(ref: CudaRef, nbytes: int, index: int) -> torch.Tensor:
    if nbytes > ref.storage_bytes:
        raise FrameInvalid(f"cuda frame: a bucket of {nbytes} bytes in a storage of {ref.storage_bytes}")
    # torch.multiprocessing.reductions.rebuild_cuda_tensor's storage step, from the checked fields
    storage = torch.UntypedStorage._new_shared_cuda(
        index,
        ref.handle,
        ref.storage_bytes,
        ref.storage_offset,
        ref.ref_counter,
        ref.ref_counter_offset,
        ref.event,
        True,
    )
    whole = torch.empty(0, dtype=torch.uint8, device=f"cuda:{index}")
    whole.set_(storage, 0, (ref.storage_bytes,), (1,))
    return whole[:nbytes]


__all__ = ["Frame", "FrameInvalid", "decode", "from_json", "open_bucket"]
