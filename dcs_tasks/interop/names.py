"""Tensor names of a committed step as the state saw them: every path a tensor has in the structure.

A step stores a tied tensor once (under the first path that reached it) and its structure names that stored
tensor wherever the state held it, so walking the structure gives every (path, stored name) pair, in the
order `flatten_state` visited them. The structure has already been checked (`validate.check_manifest`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dcs_tasks.errors import CheckpointError


@dataclass(frozen=True)
class TensorPath:
    """One place a tensor sits in the saved state: `path` (keys joined by "/") and the stored tensor name."""

    path: str
    stored: str
    dtensor: bool = False


def tensor_paths(structure: Any) -> list[TensorPath]:
    """Every tensor node of `structure` with its path, in traversal order (tied tensors appear once per path)."""
    out: list[TensorPath] = []
    _walk(structure, (), out)
    return out


def _walk(node: Any, path: tuple[str, ...], out: list[TensorPath]) -> None:
    kind = node.get("k") if isinstance(node, dict) else None
    if kind in ("tensor", "dtensor"):
        out.append(TensorPath("/".join(path), str(node["name"]), kind == "dtensor"))
    elif kind in ("dict", "odict"):
        for key, value in zip(node["keys"], node["values"], strict=True):
            _walk(value, (*path, str(key["v"])), out)
    elif kind in ("list", "tuple"):
        for i, item in enumerate(node["items"]):
            _walk(item, (*path, str(i)), out)


def normalise_prefix(prefix: str) -> str:
    """`prefix` as a path prefix ending in "/" ("" selects the whole state); CheckpointError when malformed."""
    if prefix in ("", "/"):
        return ""
    if prefix.startswith("/") or "//" in prefix or len(prefix) > 1024:
        raise CheckpointError(f"prefix {prefix[:80]!r} must be state keys joined by '/', e.g. 'model/'")
    return prefix if prefix.endswith("/") else prefix + "/"


def prefix_keys(prefix: str) -> list[str]:
    """The state keys a normalised prefix names ("model/" -> ["model"])."""
    return [key for key in prefix.split("/") if key]
