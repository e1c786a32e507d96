"""Bounds on what a client may store in Redis through the coordinator (checked before anything is written)."""

from __future__ import annotations

import json
from typing import Any

# No stored metadata may nest deeper than this (the upper bound of DCS_METADATA_MAX_DEPTH): answers nest it a
# few levels further and JSON parsers (pydantic's, the clients') refuse documents nested a little over 200.
METADATA_DEPTH_CEILING = 64


def json_depth(value: Any) -> int:
    """Nesting depth of a JSON-like value (a scalar is 0, `{}` and `[]` are 1), computed without recursion."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            deepest = max(deepest, depth)
            continue
        deepest = max(deepest, depth + 1)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def json_size(value: Any) -> int:
    """Bytes of `value` as compact JSON (call only on values of bounded depth)."""
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())


def metadata_problem(metadata: dict[str, Any], max_depth: int, max_bytes: int) -> str | None:
    """Why `metadata` may not be registered (naming the limit and its setting), or None when it may."""
    depth = json_depth(metadata)
    if depth > max_depth:
        return f"metadata is nested {depth} deep; the limit is {max_depth} (DCS_METADATA_MAX_DEPTH)"
    size = json_size(metadata)
    if size > max_bytes:
        return f"metadata is {size} bytes of JSON; the limit is {max_bytes} bytes (DCS_METADATA_MAX_BYTES)"
    return None
