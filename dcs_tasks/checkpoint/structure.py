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
global tensor goes to `FlatState.dtensors` (`dcs_tasks.checkpoint.dtensor`; unsupported placements are
refused there). Since a replicated shard is written by one rank only, a rank's structure may name a
DTensor its own files do not hold; restore fetches it from the rank that does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from dcs_tasks.checkpoint import dtensor
from dcs_tasks.checkpoint.stageable import check_stageable
from dcs_tasks.errors import CorruptCheckpoint, StagingError

Node = dict[str, Any]


@dataclass(frozen=True)
class FlatState:
    """`tensors` in traversal order (name -> tensor) and the JSON `structure` that rebuilds the state."""

    tensors: dict[str, torch.Tensor]
    structure: Node
    dtensors: dict[str, dtensor.ShardMeta] = field(default_factory=dict)  # name -> where its local shard sits


class _Flattener:
    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.dtensors: dict[str, dtensor.ShardMeta] = {}
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
        if dtensor.is_dtensor(tensor):
            tensor, meta = dtensor.local_part(tensor, where)  # refuses unsupported placements
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

MAX_DEPTH = 200  # nesting levels accepted (a training state has a handful)
MAX_NAME = 4096  # characters of a tensor name a dtensor node may hold
_DTYPES: dict[str, torch.dtype] = {
    str(value).removeprefix("torch."): value for value in vars(torch).values() if isinstance(value, torch.dtype)
}
_FIELDS: dict[str, frozenset[str]] = {
    "tensor": frozenset({"k", "name"}),
    "dtensor": frozenset({"k", "name"}),
    "dict": frozenset({"k", "keys", "values"}),
    "odict": frozenset({"k", "keys", "values"}),
    "list": frozenset({"k", "items"}),
    "tuple": frozenset({"k", "items"}),
    "size": frozenset({"k", "v"}),
}
_SCALAR_KINDS = frozenset({"v", "float", "dtype", "device"})


def unflatten_state(structure: Any, tensors: Mapping[str, Any]) -> Any:
    """Rebuild the state described by `structure`, taking tensors by name from `tensors`. Only what
    `flatten_state` writes is accepted (node kinds, their fields, plain JSON values, real torch dtypes and
    device strings); anything else raises CorruptCheckpoint naming where in the structure it is."""
    return _Decoder(tensors).node(structure, 0, "<root>")


def check_structure(structure: Any, names: Collection[str]) -> None:
    """Decode `structure` without tensors (names only): CorruptCheckpoint if `unflatten_state` would refuse it.
    A `dtensor` node may name a tensor this rank's files do not hold (another rank wrote that shard)."""
    _Decoder(dict.fromkeys(names), lenient_dtensors=True).node(structure, 0, "<root>")


def _bad(where: str, reason: str) -> CorruptCheckpoint:
    return CorruptCheckpoint(f"structure at {where}: {reason}")


class _Decoder:
    def __init__(self, tensors: Mapping[str, Any], lenient_dtensors: bool = False) -> None:
        self.tensors = tensors
        self.lenient_dtensors = lenient_dtensors

    def node(self, raw: Any, depth: int, where: str) -> Any:
        if depth > MAX_DEPTH:
            raise _bad(where, f"nested deeper than {MAX_DEPTH} levels")
        kind = _kind(raw, where)
        if kind in _SCALAR_KINDS:
            return _scalar_value(raw, where)
        fields = _FIELDS.get(kind)
        if fields is None:
            raise _bad(where, f"unknown node kind {kind!r}")
        if kind in ("dict", "odict"):
            return self._mapping(raw, kind, depth, where)
        _expect_fields(raw, fields, where)
        if kind in ("tensor", "dtensor"):
            name = raw["name"]
            if isinstance(name, str) and kind == "dtensor" and self.lenient_dtensors and len(name) <= MAX_NAME:
                return self.tensors.get(name)
            if not isinstance(name, str) or name not in self.tensors:
                raise _bad(where, f"names tensor {name!r}, which the manifest does not hold")
            return self.tensors[name]
        if kind == "size":
            return torch.Size(_sizes(raw["v"], where))
        items = [self.node(item, depth + 1, f"{where}/{i}") for i, item in enumerate(_list(raw["items"], where))]
        return items if kind == "list" else tuple(items)

    def _mapping(self, raw: Node, kind: str, depth: int, where: str) -> Any:
        _expect_fields(raw, _FIELDS[kind] | ({"meta"} if "meta" in raw else set()), where)
        keys = [_scalar_value(k, f"{where}/<key {i}>") for i, k in enumerate(_list(raw["keys"], where))]
        values = _list(raw["values"], where)
        if len(keys) != len(values):
            raise _bad(where, f"{len(keys)} keys but {len(values)} values")
        pairs = [(k, self.node(v, depth + 1, f"{where}/{k}")) for k, v in zip(keys, values, strict=True)]
        meta = _module_meta(raw["meta"], where) if "meta" in raw else None
        if kind == "dict":
            return dict(pairs)
        rebuilt: OrderedDict[Any, Any] = OrderedDict(pairs)
        if meta is not None:
            rebuilt._metadata = meta  # type: ignore[attr-defined]
        return rebuilt


def _kind(raw: Any, where: str) -> str:
    if not isinstance(raw, dict):
        raise _bad(where, f"a node must be a JSON object, not {type(raw).__name__}")
    kind = raw.get("k")
    if not isinstance(kind, str):
        raise _bad(where, "node has no kind")
    return kind


def _expect_fields(raw: Node, fields: Collection[str], where: str) -> None:
    if set(raw) != set(fields):
        raise _bad(where, f"{raw['k']!r} node has fields {sorted(raw)}, expected {sorted(fields)}")


def _list(raw: Any, where: str) -> list[Any]:
    if not isinstance(raw, list):
        raise _bad(where, f"expected a JSON list, not {type(raw).__name__}")
    return raw


def _sizes(raw: Any, where: str) -> list[int]:
    dims = _list(raw, where)
    if not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**63 for d in dims):
        raise _bad(where, "a size must be a list of non-negative integers")
    return dims


def _module_meta(raw: Any, where: str) -> OrderedDict[str, dict[str, Any]]:
    """`state_dict()._metadata`: {module prefix: {str: None/bool/int/str}}."""
    if not isinstance(raw, dict) or not all(isinstance(entry, dict) for entry in raw.values()):
        raise _bad(where, "module metadata must map prefixes to JSON objects")
    for entry in raw.values():
        if not all(v is None or isinstance(v, bool | int | str) for v in entry.values()):
            raise _bad(where, "module metadata values must be null, booleans, integers or strings")
    return OrderedDict((prefix, dict(entry)) for prefix, entry in raw.items())


def _scalar_value(raw: Any, where: str) -> Any:
    kind = _kind(raw, where)
    if kind not in _SCALAR_KINDS:
        raise _bad(where, f"{kind!r} is not a plain value")
    _expect_fields(raw, ("k", "v"), where)
    value = raw["v"]
    if kind == "v":
        if value is None or isinstance(value, bool | int | str):
            return value
        raise _bad(where, f"a plain value must be null, a boolean, an integer or a string, not {type(value).__name__}")
    if not isinstance(value, str):
        raise _bad(where, f"a {kind} is written as a string, not {type(value).__name__}")
    if kind == "dtype":
        if value not in _DTYPES:
            raise _bad(where, f"{value[:64]!r} is not a torch dtype")
        return _DTYPES[value]
    try:
        return float.fromhex(value) if kind == "float" else torch.device(value)
    except (ValueError, RuntimeError, OverflowError) as exc:
        raise _bad(where, f"{value[:64]!r} is not a valid {kind}") from exc
