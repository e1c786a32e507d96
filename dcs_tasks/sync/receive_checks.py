"""What a `WeightReceiver` (`dcs receiver`'s, an actor_fwd's, a reference's) checks before it acts on a request:
the checks run before any tensor is allocated or any connection opened, and a refusal is a `RequestRejected`
naming what was wrong (answered 400 by `dcs receiver`).

Update bodies: every dtype from `fusion`'s table, every shape non-negative with at most `MAX_DIMS` dims, names
unique, 1..`MAX_NAME_LENGTH` characters and at most `MAX_TENSORS` of them, the total bytes within the update
limit. Init bodies: a plausible host name or IP literal, a bounded world size with the rank inside it, a
group name of safe characters. (`dcs_tasks.sync.receiver.guard` wraps the HTTP app: token, JSON errors.)
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence

from dcs_tasks.backends.base import GroupSpec
from dcs_tasks.backends.fusion import parse_dtype
from dcs_tasks.errors import RequestRejected

MAX_TENSORS = 1_000_000  # per request
MAX_NAME_LENGTH = 1024
MAX_DIMS = 16
MAX_WORLD_SIZE = 65_536
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9\-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(?:\.{_LABEL})*$")
_GROUP_NAME = re.compile(r"^[A-Za-z0-9_.:\-]{1,256}$")


def tensor_bytes(dtype: str, shape: Sequence[int]) -> int:
    """Bytes of one tensor (exact Python integers: no overflow); RequestRejected for a bad dtype or shape."""
    try:
        itemsize = parse_dtype(dtype).itemsize
    except ValueError as exc:
        raise RequestRejected(str(exc)) from None
    if len(shape) > MAX_DIMS:
        raise RequestRejected(f"shape {list(shape)[: MAX_DIMS + 1]}... has more than {MAX_DIMS} dimensions")
    numel = 1
    for dim in shape:
        if dim < 0:
            raise RequestRejected(f"shape {list(shape)} has a negative dimension")
        numel *= dim
    return numel * itemsize


def check_names(names: Sequence[str]) -> None:
    if len(names) > MAX_TENSORS:
        raise RequestRejected(f"{len(names)} tensors in one request; at most {MAX_TENSORS}")
    for name in names:
        if not 0 < len(name) <= MAX_NAME_LENGTH:
            raise RequestRejected(f"tensor name {name[:64]!r} must be 1..{MAX_NAME_LENGTH} characters")
    if len(set(names)) != len(names):
        raise RequestRejected("tensor names repeat within one request")


def check_tensors(
    names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]], max_bytes: int | None
) -> int:
    """The payload bytes of the tensors announced, once they passed every check; RequestRejected otherwise."""
    if not len(names) == len(dtypes) == len(shapes):
        raise RequestRejected(f"names/dtypes/shapes lengths differ: {len(names)}/{len(dtypes)}/{len(shapes)}")
    check_names(names)
    total = 0
    for dtype, shape in zip(dtypes, shapes, strict=True):
        total += tensor_bytes(dtype, shape)
        if max_bytes is not None and total > max_bytes:
            raise RequestRejected(
                f"update announces more than {max_bytes} bytes (receiver_max_update_bytes); refused before allocating"
            )
    return total


def check_address(address: str) -> None:
    """An IP literal or a syntactically valid host name (no URL, port, path or spaces)."""
    try:
        ipaddress.ip_address(address)
        return
    except ValueError:
        pass
    if not _HOSTNAME.match(address):
        raise RequestRejected(f"master_address {address[:80]!r} is neither an IP address nor a host name")


def check_group_spec(spec: GroupSpec) -> None:
    """RequestRejected unless `spec` names a plausible group to join."""
    check_address(spec.master_address)
    if not _GROUP_NAME.match(spec.group_name):
        raise RequestRejected(f"group_name {spec.group_name[:80]!r} must be 1..256 of A-Z a-z 0-9 _ . : -")
    if not 0 < spec.world_size <= MAX_WORLD_SIZE:
        raise RequestRejected(f"world_size {spec.world_size} must be 1..{MAX_WORLD_SIZE}")
    if not 0 <= spec.rank < spec.world_size:
        raise RequestRejected(f"rank {spec.rank} must be below world_size {spec.world_size}")
