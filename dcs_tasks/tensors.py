"""The dtypes DCS moves (one table) and `TensorSpec`, the one description of a tensor: checkpoints and weight sync.

Both paths move raw bytes, never casts: a checkpoint stages `tensor.view(torch.uint8)` into safetensors files,
a weight update broadcasts uint8 buffers (fused buckets, or a tensor's own memory viewed as bytes). So a dtype
either travels bit-exactly or not at all, and what decides it is whether the other end can name it:

| DCS name | safetensors code | checkpoint | weight sync |
| --- | --- | --- | --- |
| float64, float32, float16, bfloat16 | F64, F32, F16, BF16 | yes | yes |
| int64, int32, int16, int8, uint8 | I64, I32, I16, I8, U8 | yes | yes |
| uint16, uint32, uint64 | U16, U32, U64 | yes | yes |
| bool | BOOL | yes | yes |
| float8_e4m3fn, float8_e5m2 | F8_E4M3, F8_E5M2 | yes | yes |
| complex64 | C64 | yes | yes |
| complex128 | (none) | no: `UnsupportedDtype` | yes |

The DCS name is torch's spelling without `torch.` (what SGLang's weight-update API and DCS's settings use);
the safetensors code is what a checkpoint file's header and `manifest.json` carry. safetensors has no code for
128-bit complex numbers, so a complex128 tensor is refused by name rather than stored as a view that other
safetensors readers would load as the wrong dtype. Any dtype not in the table (e.g. the `fnuz` float8
variants, quantized or sub-byte dtypes) is refused by both paths with `UnsupportedDtype`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dcs_tasks.errors import InvalidTensorSpec, UnsupportedDtype

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DtypeInfo:
    """One row of the table: `code` is None where safetensors (so a checkpoint) cannot store the dtype.

    The table needs no torch: a worker that only moves a checkpoint's bytes reads names, codes and sizes, and
    does not import it. `torch_dtype` imports torch on first use."""

    name: str
    code: str | None
    itemsize: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return _torch_dtypes()[self.name]


DTYPES: tuple[DtypeInfo, ...] = (
    DtypeInfo("float64", "F64", 8),
    DtypeInfo("float32", "F32", 4),
    DtypeInfo("float16", "F16", 2),
    DtypeInfo("bfloat16", "BF16", 2),
    DtypeInfo("int64", "I64", 8),
    DtypeInfo("int32", "I32", 4),
    DtypeInfo("int16", "I16", 2),
    DtypeInfo("int8", "I8", 1),
    DtypeInfo("uint8", "U8", 1),
    DtypeInfo("uint16", "U16", 2),
    DtypeInfo("uint32", "U32", 4),
    DtypeInfo("uint64", "U64", 8),
    DtypeInfo("bool", "BOOL", 1),
    DtypeInfo("float8_e4m3fn", "F8_E4M3", 1),
    DtypeInfo("float8_e5m2", "F8_E5M2", 1),
    DtypeInfo("complex64", "C64", 8),
    DtypeInfo("complex128", None, 16),
)
_BY_NAME: dict[str, DtypeInfo] = {row.name: row for row in DTYPES}
_BY_CODE: dict[str, DtypeInfo] = {row.code: row for row in DTYPES if row.code is not None}
# The element size of each safetensors code (what validating a checkpoint file's header needs).
CODE_ITEMSIZE: dict[str, int] = {code: row.itemsize for code, row in _BY_CODE.items()}


@functools.cache
def _torch_dtypes() -> dict[str, torch.dtype]:
    """name -> torch dtype for the whole table, built on first use (tests/unit check the sizes against torch)."""
    import torch

    return {row.name: getattr(torch, row.name) for row in DTYPES}


@functools.cache
def _by_torch() -> dict[torch.dtype, DtypeInfo]:
    dtypes = _torch_dtypes()
    return {dtypes[row.name]: row for row in DTYPES}


@functools.cache
def _checkpoint_maps() -> tuple[dict[torch.dtype, str], dict[str, torch.dtype]]:
    dtypes = _torch_dtypes()
    coded = [row for row in DTYPES if row.code is not None]
    return {dtypes[r.name]: r.code for r in coded}, {r.code: dtypes[r.name] for r in coded}  # type: ignore[misc]


def code_dtype(code: str) -> torch.dtype:
    """The torch dtype of a safetensors code a checkpoint stores (KeyError for any other code)."""
    return _torch_dtypes()[_BY_CODE[code].name]


def __getattr__(name: str) -> Any:
    """The checkpoint's view of the table, torch dtype <-> safetensors code for the dtypes a checkpoint stores:
    `DTYPE_CODES` and `CODE_DTYPES`, built (importing torch) on first use."""
    if name == "DTYPE_CODES":
        return _checkpoint_maps()[0]
    if name == "CODE_DTYPES":
        return _checkpoint_maps()[1]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _about(tensor: str | None) -> str:
    return f"tensor {tensor!r} has " if tensor is not None else ""


def _known(choices: Iterable[str]) -> str:
    return ", ".join(sorted(choices))


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.float32` -> `"float32"` (the spelling SGLang's HTTP API uses), for any torch dtype."""
    return str(dtype).removeprefix("torch.")


def info_of(dtype: torch.dtype, tensor: str | None = None) -> DtypeInfo:
    """The table's row for `dtype`; UnsupportedDtype (naming `tensor`, when given) for a dtype DCS cannot move."""
    row = _by_torch().get(dtype)
    if row is None:
        raise UnsupportedDtype(
            f"{_about(tensor)}dtype {dtype_name(dtype)!r}, which DCS can neither checkpoint nor sync; "
            f"supported: {_known(_BY_NAME)}"
        )
    return row


def info_named(name: str, tensor: str | None = None) -> DtypeInfo:
    """The row of a DCS name (`"float32"`, or `"torch.float32"`): what the weight-sync wire carries."""
    row = _BY_NAME.get(name.removeprefix("torch."))
    if row is None:
        raise UnsupportedDtype(f"{_about(tensor)}unsupported dtype {name[:64]!r}; known: {_known(_BY_NAME)}")
    return row


def info_coded(code: str, tensor: str | None = None) -> DtypeInfo:
    """The row of a safetensors code (`"F32"`): what a checkpoint header or manifest carries."""
    row = _BY_CODE.get(code)
    if row is None:
        raise UnsupportedDtype(
            f"{_about(tensor)}unsupported safetensors dtype {code[:64]!r}; known: {_known(_BY_CODE)}"
        )
    return row


def parse_dtype(name: str) -> torch.dtype:
    """`"float32"` or `"torch.float32"` -> `torch.float32`; UnsupportedDtype (a ValueError) for any other name."""
    return info_named(name).torch_dtype


def checkpoint_code(dtype: torch.dtype, tensor: str | None = None) -> str:
    """The safetensors code of `dtype`; UnsupportedDtype naming `tensor` where a checkpoint cannot store it."""
    row = info_of(dtype, tensor)
    if row.code is None:
        raise UnsupportedDtype(
            f"{_about(tensor)}dtype {row.name!r}, which safetensors cannot store, so DCS cannot checkpoint it "
            f"(weight sync carries it); checkpointable: {_known(_BY_CODE)} in safetensors codes"
        )
    return row.code


def _spelled(dtype: str, tensor: str) -> DtypeInfo:
    """A spec's dtype as either spelling: DCS name (weight sync) or safetensors code (checkpoint files)."""
    row = _BY_NAME.get(dtype.removeprefix("torch.")) or _BY_CODE.get(dtype)
    if row is None:
        raise UnsupportedDtype(
            f"tensor {tensor!r} has unsupported dtype {dtype[:64]!r}; known: {_known(_BY_NAME)} "
            f"(or their safetensors codes {_known(_BY_CODE)})"
        )
    return row


@dataclass(frozen=True, eq=False)
class TensorSpec:
    """Name, dtype and shape of one tensor: what a checkpoint header records and what crosses the sync wire
    ahead of its bytes. `nbytes` follows from dtype and shape; a caller that knows it from elsewhere (a manifest's
    offsets) may pass it, and a value that disagrees is refused (InvalidTensorSpec).

    `dtype` keeps the spelling it was given: specs of a checkpoint layout are spelled in safetensors codes (the
    file header's words, `checkpoint()`), specs of a weight update in DCS names (SGLang's, `TensorSpec.of`).
    `dtype_name`, `code` and `torch_dtype` read either, and two specs are equal whatever the spelling."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int = -1
    info: DtypeInfo = field(init=False, repr=False)

    def __post_init__(self) -> None:
        info = _spelled(self.dtype, self.name)
        size = math.prod(self.shape) * info.itemsize
        if self.nbytes not in (-1, size):
            raise InvalidTensorSpec(
                f"tensor {self.name!r}: {self.nbytes} bytes given, but {info.name}{list(self.shape)} is {size} bytes"
            )
        object.__setattr__(self, "info", info)
        object.__setattr__(self, "nbytes", size)

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorSpec:
        """The spec of `tensor`, spelled in DCS names; UnsupportedDtype naming it for a dtype not in the table."""
        return cls(name, info_of(tensor.dtype, name).name, tuple(tensor.shape))

    @property
    def torch_dtype(self) -> torch.dtype:
        return self.info.torch_dtype

    @property
    def itemsize(self) -> int:
        return self.info.itemsize

    @property
    def dtype_name(self) -> str:
        return self.info.name

    @property
    def code(self) -> str:
        """The safetensors code; UnsupportedDtype naming this tensor where a checkpoint cannot store its dtype."""
        return checkpoint_code(self.info.torch_dtype, self.name)

    def checkpoint(self) -> TensorSpec:
        """This spec spelled in safetensors codes (as a checkpoint file's header records it)."""
        return self if self.dtype == self.code else TensorSpec(self.name, self.code, self.shape)

    def _key(self) -> tuple[str, str, tuple[int, ...]]:
        return self.name, self.info.name, tuple(self.shape)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TensorSpec) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


def specs_of(tensors: Mapping[str, torch.Tensor]) -> list[TensorSpec]:
    """The checkpoint specs (safetensors codes) of `tensors`; UnsupportedDtype names one that cannot be stored."""
    return [TensorSpec.of(name, t).checkpoint() for name, t in tensors.items()]
