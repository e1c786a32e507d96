"""Transfer-time quantization: cast selected floating tensors to a narrower dtype before sending."""

from __future__ import annotations

import torch

from dcs_tasks.sync.wire import QuantizationConfig
from dcs_tasks.tensors import TensorSpec, dtype_name, info_named, parse_dtype


def wire_spec(spec: TensorSpec, config: QuantizationConfig | None) -> TensorSpec:
    """The spec a tensor has on the wire under `config`."""
    if config is None or spec.dtype_name not in config.source_dtypes:
        return spec
    return TensorSpec(spec.name, info_named(config.dtype, spec.name).name, spec.shape)


def to_wire(tensor: torch.Tensor, config: QuantizationConfig | None) -> torch.Tensor:
    """`tensor` cast for transfer (no copy when `config` does not apply to it)."""
    if config is None or dtype_name(tensor.dtype) not in config.source_dtypes:
        return tensor
    return tensor.to(parse_dtype(config.dtype))


def relative_error_bound(dtype: str) -> float:
    """Worst relative rounding error of a cast to `dtype` (normal range, round to nearest)."""
    bounds = {"bfloat16": 2.0**-8, "float16": 2.0**-11, "float32": 2.0**-24}
    return bounds[dtype]
