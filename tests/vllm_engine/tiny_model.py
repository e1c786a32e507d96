"""The model of a harness engine: four tensors on CPU, loaded the way vLLM's models load (replaces the GPU model).

Each parameter carries a vLLM `weight_loader` (vLLM's `default_weight_loader` for replicated ones; for TP-sharded
ones a loader that keeps this rank's rows, as vLLM's parallel linear layers do), `load_weights` goes through them,
and `record_metadata_for_reloading` runs after construction as vLLM's model loader does, so the layerwise reload
(`initialize_layerwise_reload` / `finalize_layerwise_reload`, driven by the weight-transfer engine's start and
finish) is vLLM's own code acting on this model.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from vllm.model_executor.model_loader.reload import record_metadata_for_reloading
from vllm.model_executor.model_loader.weight_utils import default_weight_loader

from tests.vllm_engine.shapes import SHAPES, SHARDED


class _Block(torch.nn.Module):
    pass


class TinyModel(torch.nn.Module):
    def __init__(self, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.parts: dict[str, torch.nn.Parameter] = {}
        self.holders: dict[str, tuple[torch.nn.Module, str]] = {}
        for name, (shape, dtype) in SHAPES.items():
            rows = shape[0] // tp_size if name in SHARDED else shape[0]
            param = torch.nn.Parameter(torch.zeros((rows, *shape[1:]), dtype=dtype), requires_grad=False)
            param.weight_loader = self._sharded_loader if name in SHARDED else default_weight_loader  # type: ignore[attr-defined]
            holder = _Block()
            leaf = name.rsplit(".", 1)[1]
            holder.register_parameter(leaf, param)
            self.add_module(name.rsplit(".", 1)[0].replace(".", "_"), holder)
            self.holders[name] = (holder, leaf)
        record_metadata_for_reloading(self)

    def _sharded_loader(self, param: torch.nn.Parameter, loaded: torch.Tensor) -> None:
        rows = param.shape[0]
        param.data.copy_(loaded.narrow(0, self.tp_rank * rows, rows))

    def param(self, name: str) -> torch.nn.Parameter:
        holder, leaf = self.holders[name]
        return getattr(holder, leaf)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = set()
        for name, tensor in weights:
            if name not in self.holders:
                raise KeyError(f"unknown weight {name!r}")
            param = self.param(name)
            param.weight_loader(param, tensor)  # type: ignore[attr-defined]
            loaded.add(name)
        return loaded

    def local_state(self) -> dict[str, torch.Tensor]:
        return {name: self.param(name).detach().clone() for name in SHAPES}


class SinkModel(torch.nn.Module):
    """For benchmarks (`serve.py --sink-model`): holds whatever weights arrive under whatever names (the first load
    of a name allocates it, later ones copy into it in place), so a trainer's arbitrary state can be pushed."""

    def __init__(self, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.held: dict[str, torch.Tensor] = {}
        record_metadata_for_reloading(self)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = set()
        for name, tensor in weights:
            if name in self.held:
                self.held[name].copy_(tensor)
            else:
                self.held[name] = tensor.clone()
            loaded.add(name)
        return loaded

    def local_state(self) -> dict[str, torch.Tensor]:
        return dict(self.held)
