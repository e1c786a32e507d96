"""The engine's model: a tiny CPU nn.Module standing in for SGLang's GPU model classes.

It behaves like SGLang's model classes (e.g. sglang/srt/models/llama.py) where a weight update touches them:
`load_weights(iterable of (name, tensor))` copies each named tensor into its parameter through the
parameter's `weight_loader` (`default_weight_loader` for replicated ones, a tensor-parallel loader that keeps
this rank's rows for sharded ones) and silently skips names it does not have; `get_weights_by_name(name,
truncate_size, tp_size)` answers `tensor.float().tolist()[:truncate_size]` of the full (TP-gathered) weight.

Parameters (HF-checkpoint names, as a trainer sends them):
- `model.embed_tokens.weight` (VOCAB, HIDDEN) float32, replicated on every TP rank;
- `model.layers.0.mlp.up_proj.weight` (INTERMEDIATE, HIDDEN) float32, sharded by rows across TP ranks
  (like a column-parallel linear layer: each rank receives the full tensor and keeps its rows);
- `model.norm.weight` (HIDDEN,) bfloat16, replicated;
- `lm_head.weight` (VOCAB, HIDDEN) float16, replicated.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

WeightLoader = Callable[[torch.Tensor, torch.Tensor], None]
VOCAB = 16
HIDDEN = 8
INTERMEDIATE = 12

SHARDED = "model.layers.0.mlp.up_proj.weight"
SHAPES: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "model.embed_tokens.weight": ((VOCAB, HIDDEN), torch.float32),
    SHARDED: ((INTERMEDIATE, HIDDEN), torch.float32),
    "model.norm.weight": ((HIDDEN,), torch.bfloat16),
    "lm_head.weight": ((VOCAB, HIDDEN), torch.float16),
}


def hf_config() -> dict[str, Any]:
    """config.json of the served 'model' (a tiny Llama, so SGLang's ModelConfig resolves it on CPU)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "num_hidden_layers": 1,
        "vocab_size": VOCAB,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-6,
        "torch_dtype": "float32",
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def initial_value(name: str) -> torch.Tensor:
    """The weights every engine starts with (deterministic, distinct per parameter)."""
    shape, dtype = SHAPES[name]
    numel = 1
    for dim in shape:
        numel *= dim
    base = float(sorted(SHAPES).index(name) + 1)
    return (torch.arange(numel, dtype=torch.float32) / 100.0 + base).reshape(shape).to(dtype)


class TinyModel(nn.Module):
    """One TP rank's model; `group` is the TP group (for gathering sharded weights on read)."""

    def __init__(
        self, tp_rank: int, tp_size: int, group: Any = None, default_loader: WeightLoader | None = None
    ) -> None:
        super().__init__()
        if INTERMEDIATE % tp_size:
            raise ValueError(f"tp_size {tp_size} does not divide {INTERMEDIATE} rows")
        self.tp_rank, self.tp_size, self.group = tp_rank, tp_size, group
        for name in SHAPES:
            full = initial_value(name)
            data = self._shard(full) if name == SHARDED else full
            param = nn.Parameter(data.clone(), requires_grad=False)
            loader = self._sharded_loader if name == SHARDED else (default_loader or _default_loader)
            param.weight_loader = loader  # type: ignore[attr-defined]
            *path, leaf = name.split(".")
            module: nn.Module = self
            for part in path:
                if part not in dict(module.named_children()):
                    module.add_module(part, nn.ModuleDict())
                module = module.get_submodule(part)
            module.register_parameter(leaf, param)

    def _shard(self, full: torch.Tensor) -> torch.Tensor:
        rows = full.shape[0] // self.tp_size
        return full.narrow(0, self.tp_rank * rows, rows)

    def _sharded_loader(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        shard = self._shard(loaded)
        assert param.size() == shard.size(), (
            f"Attempted to load weight ({shard.size()}) into parameter ({param.size()})"
        )
        param.data.copy_(shard)

    def params(self) -> dict[str, nn.Parameter]:
        return dict(self.named_parameters())

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """SGLang's contract: copy known names through their weight_loader, skip unknown names."""
        loaded: set[str] = set()
        params = self.params()
        for name, tensor in weights:
            if name in params:
                params[name].weight_loader(params[name], tensor)  # type: ignore[attr-defined]
                loaded.add(name)
        return loaded

    def full_weight(self, name: str) -> torch.Tensor:
        """The whole tensor: sharded weights are all-gathered over the TP group (collective on every rank)."""
        param = self.params()[name].data
        if name != SHARDED or self.tp_size == 1:
            return param
        parts = [torch.empty_like(param) for _ in range(self.tp_size)]
        torch.distributed.all_gather(parts, param.contiguous(), group=self.group)
        return torch.cat(parts, dim=0)

    def get_weights_by_name(self, name: str, truncate_size: int = 100, tp_size: int = 1) -> list[Any] | None:
        """Like LlamaForCausalLM.get_weights_by_name: float32 `tolist()` of the first `truncate_size` rows."""
        if name not in self.params():
            return None
        return self.full_weight(name).cpu().to(torch.float32).numpy().tolist()[:truncate_size]


def _default_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """sglang.srt.model_loader.weight_utils.default_weight_loader's contract."""
    assert param.size() == loaded.size(), f"Attempted to load weight ({loaded.size()}) into parameter ({param.size()})"
    param.data.copy_(loaded)
