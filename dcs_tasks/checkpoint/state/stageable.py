"""Which tensors `save()` can stage as raw bytes, checked before any of their memory is touched.

Staging copies a tensor's bytes (memmove from `data_ptr()`, or `copy_` into a dtype view), so only a
strided, storage-backed tensor of a safetensors dtype can be staged. Everything else is refused with a
`StagingError` naming the state path and the type, before anything reads the tensor's memory:
- tensor subclasses that override `__torch_dispatch__` (wrapper subclasses with no storage of their own:
  fake and functorch tensors, float8/NF4 wrappers). A `DTensor` never reaches this check as itself:
  `structure` hands over its local shard (`dcs_tasks.checkpoint.restore.boxread`), since the DTensor's own
  `data_ptr()` is 0 and a raw copy of it would kill the process with SIGSEGV;
- nested tensors (no strides), sparse (COO/CSR/CSC/BSR/BSC) and mkldnn layouts, quantized tensors,
  meta-device tensors, uninitialized (lazy) parameters and buffers;
- dtypes safetensors cannot store (complex, qint, ...).
Plain tensors, `nn.Parameter` and subclasses that only customise `__torch_function__` are staged;
non-contiguous views are copied element by element (`copy_`), which also resolves lazy neg/conj bits.
"""

from __future__ import annotations

from typing import Any

import torch

from dcs_tasks.checkpoint.format.layout import DTYPE_CODES
from dcs_tasks.errors import StagingError

_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__
_UNINITIALIZED: Any = getattr(torch.nn.parameter, "UninitializedTensorMixin", ())  # lazy modules' params
DTENSOR_HINT = " (DCS saves a DTensor's local shard: pass the DTensor itself)"


def _problem(tensor: torch.Tensor) -> str | None:
    """Why `tensor` cannot be staged as raw bytes, or None. Reads attributes only, never memory."""
    kind = type(tensor)
    if getattr(kind, "__torch_dispatch__", _PLAIN_DISPATCH) is not _PLAIN_DISPATCH:
        hint = DTENSOR_HINT if kind.__name__ == "DTensor" else ""
        return f"a {kind.__name__} is a tensor subclass without plain storage{hint}"
    if isinstance(tensor, _UNINITIALIZED):
        return "it is not initialized yet (lazy module)"
    if tensor.is_nested:
        return "nested tensors have no fixed shape"
    if tensor.layout is not torch.strided:
        return f"layout {tensor.layout} is not strided (sparse and mkldnn tensors cannot be staged)"
    if tensor.is_quantized:
        return f"quantized tensors ({tensor.dtype}) cannot be staged"
    if tensor.device.type == "meta":
        return "a meta tensor has no data"
    if tensor.dtype not in DTYPE_CODES:
        return f"dtype {tensor.dtype} cannot be stored in safetensors"
    return None


def check_stageable(tensor: torch.Tensor, where: str) -> None:
    """Raise StagingError naming `where` (the state path) and the type when `tensor` cannot be staged."""
    problem = _problem(tensor)
    if problem is None and tensor.device.type == "cpu" and tensor.numel() > 0:
        try:
            if tensor.data_ptr() == 0:
                problem = "it has no data in memory"
        except RuntimeError as exc:  # e.g. functorch-wrapped tensors: no storage to read
            problem = f"its storage cannot be read ({exc})"
    if problem is not None:
        raise StagingError(f"cannot checkpoint {type(tensor).__name__} at {where!r}: {problem}")
