"""Flatten a training state into named tensors plus a JSON description of everything else, and back.

A state is what trainers save: nested dicts (str or int keys, `OrderedDict` kept), lists, tuples,
tensors of any dtype (views and non-contiguous tensors included) and plain values (None, bool, int,
float, str, `torch.dtype`, `torch.Size`, `torch.device`). The description is pure JSON, so it travels
in the manifest; floats are stored with `float.hex` so that NaN, inf and -0.0 survive bit-exactly.
Anything else (arbitrary objects) is refused: DCS never pickles.

Tied tensors (the same tensor, or the same view of the same storage, under two keys, e.g. an embedding
shared with the output head) are saved once and come back as one tensor under both keys. The `_metadata`
attribute `nn.Module.state_dict()` attaches (per-module versions that `load_state_dict` passes to
`_load_from_state_dict`) is kept when it is plain JSON.

A torch `DTensor` becomes a `dtensor` node: its local shard is the named tensor, and its placement in the
global tensor goes to `FlatState.dtensors` (`dcs_tasks.checkpoint.state.dtensor_meta`; unsupported placements are
refused there). Since a replicated shard is written by one rank only, a rank's structure may name a
DTensor its own files do not hold; restore fetches it from the rank that does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from dcs_tasks.checkpoint.format.validate import StructureDecoder, structure_error
from dcs_tasks.checkpoint.state import dtensor_meta
from dcs_tasks.checkpoint.state.stageable import check_stageable
from dcs_tasks.errors import StagingError

Node = dict[str, Any]


@dataclass(frozen=True)
class FlatState:
    """`tensors` in traversal order (name -> tensor) and the JSON `structure` that rebuilds the state."""

    tensors: dict[str, torch.Tensor]
    structure: Node
    dtensors: dict[str, dtensor_meta.ShardMeta] = field(default_factory=dict)  # name -> where its local shard sits


class _Flattener:
    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.dtensors: dict[str, dtensor_meta.ShardMeta] = {}
        self._seen: dict[tuple[Any, ...], str] = {}  # view identity -> the name it was saved under

    def name_for(self, path: tuple[str, ...]) -> str:
        base = "/".join(path) or "tensor"
        name, n = base, 1
        while name in self.tensors:
            name, n = f"{base}#{n}", n + 1
        return name

    def node(self, value: Any, path: tuple[str, ...]) -> Node:
        if isinstance(value, torch.Tensor):
            return self._tensor(value, path)
        if isinstance(value, Mapping):
            kind = "odict" if isinstance(value, OrderedDict) else "dict"
            keys = [_scalar(k, path) for k in value]
            values = [self.node(v, (*path, str(k))) for k, v in value.items()]
            node: Node = {"k": kind, "keys": keys, "values": values}
            meta = _module_metadata(value)
            if meta is not None:
                node["meta"] = meta
            return node
        if isinstance(value, torch.Size):
            return {"k": "size", "v": list(value)}
        if isinstance(value, list | tuple):
            items = [self.node(v, (*path, str(i))) for i, v in enumerate(value)]
            return {"k": "list" if isinstance(value, list) else "tuple", "items": items}
        return _scalar(value, path)

    def _tensor(self, tensor: torch.Tensor, path: tuple[str, ...]) -> Node:
        where = "/".join(path) or "<root>"
        meta = None
        if dtensor_meta.is_dtensor(tensor):
            tensor, meta = dtensor_meta.local_part(tensor, where)  # refuses unsupported placements
        kind = "tensor" if meta is None else "dtensor"
        check_stageable(tensor, where)  # before anything reads its memory
        identity = _view_identity(tensor)
        if identity is not None and identity in self._seen:
            return {"k": kind, "name": self._seen[identity]}  # tied: stored once
        name = self.name_for(path)
        self.tensors[name] = tensor
        if meta is not None:
            self.dtensors[name] = meta
        if identity is not None:
            self._seen[identity] = name
        return {"k": kind, "name": name}


def _view_identity(tensor: torch.Tensor) -> tuple[Any, ...] | None:
    """Equal for two tensors that are the same view of the same memory (None: no storage to compare)."""
    if tensor.numel() == 0:
        return None
    return (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())


def _module_metadata(value: Mapping[Any, Any]) -> dict[str, Any] | None:
    """`state_dict()._metadata` ({module prefix: {"version": int, ...}}) when it is plain JSON, else None."""
    meta = getattr(value, "_metadata", None)
    if not isinstance(meta, Mapping):
        return None
    out: dict[str, Any] = {}
    for prefix, entry in meta.items():
        if not isinstance(prefix, str) or not isinstance(entry, Mapping):
            return None
        if not all(isinstance(k, str) and (v is None or isinstance(v, bool | int | str)) for k, v in entry.items()):
            return None
        out[prefix] = dict(entry)
    return out


def _scalar(value: Any, path: tuple[str, ...]) -> Node:
    if value is None or isinstance(value, bool | str):
        return {"k": "v", "v": value}
    if isinstance(value, int):
        return {"k": "v", "v": int(value)}
    if isinstance(value, float):
        return {"k": "float", "v": float(value).hex()}
    if isinstance(value, torch.dtype):
        return {"k": "dtype", "v": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"k": "device", "v": str(value)}
    where = "/".join(path) or "<root>"
    raise StagingError(
        f"cannot checkpoint value of type {type(value).__name__} at {where!r}: only tensors, dicts, lists, "
        "tuples and plain values are supported (DCS never pickles)"
    )


def flatten_state(state: Any) -> FlatState:
    """Split `state` into named tensors and a JSON structure. Raises StagingError on unsupported values."""
    flattener = _Flattener()
    structure = flattener.node(state, ())
    return FlatState(tensors=flattener.tensors, structure=structure, dtensors=flattener.dtensors)


# --- decoding: the structure comes from a manifest on disk, so it is untrusted input ---------------------
# The form of every node is checked by `validate.StructureDecoder` (no torch: the format stage checks it in
# every manifest); this subclass makes the torch values and refuses dtype and device names torch does not know.

_DTYPES: dict[str, torch.dtype] = {
    str(value).removeprefix("torch."): value for value in vars(torch).values() if isinstance(value, torch.dtype)
}


def unflatten_state(structure: Any, tensors: Mapping[str, Any]) -> Any:
    """Rebuild the state described by `structure`, taking tensors by name from `tensors`. Only what
    `flatten_state` writes is accepted (node kinds, their fields, plain JSON values, real torch dtypes and
    device strings); anything else raises CorruptCheckpoint naming where in the structure it is."""
    return _Decoder(tensors).node(structure, 0, "<root>")


def check_structure(structure: Any, names: Collection[str]) -> None:
    """Decode `structure` without tensors (names only): CorruptCheckpoint if `unflatten_state` would refuse it.
    A `dtensor` node may name a tensor this rank's files do not hold (another rank wrote that shard)."""
    _Decoder(dict.fromkeys(names), lenient_dtensors=True).node(structure, 0, "<root>")


class _Decoder(StructureDecoder):
    def size(self, dims: list[int]) -> Any:
        return torch.Size(dims)

    def dtype(self, value: str, where: str) -> Any:
        if value not in _DTYPES:
            raise structure_error(where, f"{value[:64]!r} is not a torch dtype")
        return _DTYPES[value]

    def device(self, value: str) -> Any:
        return torch.device(value)  # RuntimeError for a name torch does not know
