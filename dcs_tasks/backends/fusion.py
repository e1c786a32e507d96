"""Tensor fusion: many tensors of mixed dtypes packed bit-exactly into one flat uint8 buffer.

The layout is a pure function of the ordered (name, dtype, shape) triples, so a receiver that is told
only the names, dtypes and shapes of a bucket (SGLang's weight-update body) rebuilds the same offsets
and unpacks zero-copy views. Offsets are aligned to `ALIGNMENT` bytes so that every view is legal for
every dtype. Packing copies raw bytes (`tensor.view(torch.uint8)`), never casts: bit-exact for every
dtype, NaN payloads and negative zeros included.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

# The dtype table and the tensor description live in dcs_tasks.tensors (shared with checkpoints); these names
# stay importable from here for the receiver and for code written against the original design.
from dcs_tasks.tensors import TensorSpec as TensorSpec
from dcs_tasks.tensors import dtype_name as dtype_name
from dcs_tasks.tensors import info_named
from dcs_tasks.tensors import parse_dtype as parse_dtype

ALIGNMENT = 64
SGLANG_ALIGNMENT = 1  # SGLang's flattened_bucket: tensors back to back, each offset a multiple of its itemsize


def _align(n: int, alignment: int = ALIGNMENT) -> int:
    return (n + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class FusionLayout:
    """Where each tensor lives inside one flat buffer: `offsets[i]` is the byte offset of `specs[i]`."""

    specs: tuple[TensorSpec, ...]
    offsets: tuple[int, ...]
    total_bytes: int

    @classmethod
    def build(cls, specs: Iterable[TensorSpec], alignment: int = ALIGNMENT) -> FusionLayout:
        specs_t = tuple(specs)
        offsets: list[int] = []
        cursor = 0
        for spec in specs_t:
            offsets.append(cursor)
            cursor = _align(cursor + spec.nbytes, alignment)
        return cls(specs_t, tuple(offsets), cursor)

    @classmethod
    def from_wire(
        cls,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        alignment: int = ALIGNMENT,
    ) -> FusionLayout:
        """The layout of a bucket described by SGLang-style parallel lists. With `SGLANG_ALIGNMENT` (SGLang's
        `FlattenedTensorBucket.empty`) a tensor whose byte offset is not a multiple of its itemsize is refused
        with SGLang's message, as no view of it can exist."""
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(f"names/dtypes/shapes lengths differ: {len(names)}/{len(dtypes)}/{len(shapes)}")
        specs = (  # the wire speaks DCS names only ("float32"), never safetensors codes
            TensorSpec(n, info_named(d, n).name, tuple(s)) for n, d, s in zip(names, dtypes, shapes, strict=True)
        )
        layout = cls.build(specs, alignment)
        for spec, offset in zip(layout.specs, layout.offsets, strict=True):
            if any(dim < 0 for dim in spec.shape):
                raise ValueError(f"Negative dimension in received tensor {spec.name}: {list(spec.shape)}")
            if offset % spec.itemsize:
                raise ValueError(
                    f"Unaligned received tensor {spec.name}: byte offset {offset}, dtype {spec.torch_dtype}"
                )
        return layout

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.specs]

    @property
    def wire_bytes(self) -> int:
        """Bytes actually broadcast: up to the end of the last tensor (no trailing padding), so a
        one-tensor bucket is exactly that tensor's bytes and can be sent from its own memory."""
        return self.offsets[-1] + self.specs[-1].nbytes if self.specs else 0

    @property
    def payload_bytes(self) -> int:
        """Bytes of tensor data, without alignment padding."""
        return sum(s.nbytes for s in self.specs)


def pack_into(buffer: torch.Tensor, layout: FusionLayout, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Copy the raw bytes of `tensors` into `buffer` (uint8, >= layout.total_bytes); returns the view to send
    (`layout.wire_bytes` long)."""
    if buffer.dtype != torch.uint8 or buffer.numel() < layout.total_bytes:
        raise ValueError(f"buffer must be uint8 with >= {layout.total_bytes} bytes")
    pieces: list[torch.Tensor] = []  # every tensor's bytes and the padding before it, in buffer order
    cursor = 0
    for spec, offset in zip(layout.specs, layout.offsets, strict=True):
        src = tensors[spec.name]
        if src.dtype != spec.torch_dtype or tuple(src.shape) != spec.shape:
            raise ValueError(f"tensor {spec.name!r} is {src.dtype}{tuple(src.shape)}, layout says {spec}")
        if spec.nbytes:
            if offset > cursor:
                pieces.append(torch.zeros(offset - cursor, dtype=torch.uint8, device=buffer.device))
            pieces.append(src.detach().contiguous().reshape(-1).view(torch.uint8))
            cursor = offset + spec.nbytes
    view = buffer[: layout.wire_bytes]
    if pieces and layout.wire_bytes > cursor:  # trailing padding: cat must fill the view exactly (else it resizes it)
        pieces.append(torch.zeros(layout.wire_bytes - cursor, dtype=torch.uint8, device=buffer.device))
    if pieces:
        # one copy call for the whole bucket (it runs without the GIL): a Python loop of per-tensor copies cost
        # ~20 us of interpreter per tensor, i.e. most of packing a bucket of small tensors
        torch.cat(pieces, out=view)
    return view


def unpack_views(buffer: torch.Tensor, layout: FusionLayout) -> dict[str, torch.Tensor]:
    """Views of `buffer` as the tensors of `layout` (no copy; they alias the buffer)."""
    out: dict[str, torch.Tensor] = {}
    for spec, offset in zip(layout.specs, layout.offsets, strict=True):
        raw = buffer[offset : offset + spec.nbytes]
        out[spec.name] = raw.view(spec.torch_dtype).view(spec.shape)
    return out


def sglang_layout(specs: Iterable[TensorSpec]) -> FusionLayout:
    """SGLang's flattened-bucket layout of `specs`, ordered by itemsize (largest first, stable) so that every
    tensor's byte offset is a multiple of its itemsize, as SGLang's receiver requires."""
    ordered = sorted(specs, key=lambda spec: -spec.itemsize)
    return FusionLayout.build(ordered, SGLANG_ALIGNMENT)


class TensorFusion:
    """The original design's fusion API: fuse small tensors into one buffer to cut per-message overhead.

    `should_fuse` follows the original design: more than one tensor and at least `threshold_bytes` in total.
    `DeviceDirectBackend.send`/`recv` (point-to-point) ask it, with `DCSConfig.sync.tensor_fusion_threshold`, whether
    a tensor dict travels as one fused message or one message per tensor. Weight updates do not: they always
    travel in fused buckets of `bucket_size_bytes` (`plan_buckets`).
    """

    def __init__(self, threshold_bytes: int = 1024 * 1024, alignment: int = ALIGNMENT) -> None:
        self.threshold_bytes = threshold_bytes
        self.alignment = alignment

    def should_fuse(self, tensor_dict: Mapping[str, torch.Tensor]) -> bool:
        return self.should_fuse_specs([TensorSpec.of(n, t) for n, t in tensor_dict.items()])

    def should_fuse_specs(self, specs: Sequence[TensorSpec]) -> bool:
        """`should_fuse` from the description alone: what a receiver knows before any bytes arrive."""
        return len(specs) > 1 and sum(s.nbytes for s in specs) >= self.threshold_bytes

    def layout_of(self, tensor_dict: Mapping[str, torch.Tensor]) -> FusionLayout:
        return FusionLayout.build((TensorSpec.of(n, t) for n, t in tensor_dict.items()), self.alignment)

    def fuse(self, tensor_dict: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, FusionLayout]:
        """A fresh flat uint8 buffer (on the tensors' device) holding every tensor, and its layout."""
        layout = self.layout_of(tensor_dict)
        device = next(iter(tensor_dict.values())).device if tensor_dict else torch.device("cpu")
        buffer = torch.empty(layout.total_bytes, dtype=torch.uint8, device=device)
        return pack_into(buffer, layout, tensor_dict), layout

    def unfuse(self, fused_buffer: torch.Tensor, metadata: FusionLayout) -> dict[str, torch.Tensor]:
        """Views of `fused_buffer` as the original tensors (bit-identical to what was fused)."""
        return unpack_views(fused_buffer, metadata)


def plan_buckets(
    specs: Sequence[TensorSpec], bucket_size_bytes: int, alignment: int = ALIGNMENT, alone_bytes: int | None = None
) -> list[FusionLayout]:
    """Split `specs` (order kept) into layouts of at most `bucket_size_bytes`. A tensor larger than a bucket,
    or of at least `alone_bytes`, gets a bucket of its own (which a sender can broadcast without copying)."""
    alone = min(bucket_size_bytes, alone_bytes) if alone_bytes else bucket_size_bytes
    buckets: list[FusionLayout] = []
    current: list[TensorSpec] = []
    current_bytes = 0
    for spec in specs:
        size = _align(spec.nbytes, alignment)
        if current and (current_bytes + size > bucket_size_bytes or spec.nbytes >= alone):
            buckets.append(FusionLayout.build(current, alignment))
            current, current_bytes = [], 0
        current.append(spec)
        current_bytes += size
        if spec.nbytes >= alone:
            buckets.append(FusionLayout.build(current, alignment))
            current, current_bytes = [], 0
    if current:
        buckets.append(FusionLayout.build(current, alignment))
    return buckets
