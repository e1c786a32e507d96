"""The weights of a harness engine (names, full shapes, dtypes), and the trainer's model of them (no vLLM import)."""

from __future__ import annotations

import torch

SHAPES: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "model.embed_tokens.weight": ((64, 16), torch.float32),  # row-sharded across TP ranks
    "model.layers.0.mlp.down_proj.weight": ((16, 24), torch.bfloat16),
    "model.norm.weight": ((16,), torch.float16),
    "model.layers.0.mlp.mask": ((7,), torch.int8),
    **{f"model.layers.{i}.mlp.up_proj.weight": ((64, 256), torch.float32) for i in range(1, 41)},  # 64 KiB each
}
SHARDED = {"model.embed_tokens.weight"}


class TrainerModel(torch.nn.Module):
    """The trainer's side: the engine model's parameter names, full shapes and dtypes, random values."""

    def __init__(self) -> None:
        super().__init__()
        for name, (shape, dtype) in SHAPES.items():
            owner: torch.nn.Module = self
            *path, leaf = name.split(".")
            for part in path:
                if not hasattr(owner, part):
                    owner.add_module(part, torch.nn.Module())
                owner = getattr(owner, part)
            owner.register_parameter(leaf, torch.nn.Parameter(_random(shape, dtype), requires_grad=False))

    def step(self) -> None:
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(_random(tuple(p.shape), p.dtype))


def _random(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if dtype.is_floating_point:
        return (torch.randn(shape) * 3).to(dtype)
    return torch.randint(-100, 100, shape).to(dtype)
