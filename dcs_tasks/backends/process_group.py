"""Named torch.distributed groups without a default process group.

`torch.distributed.init_process_group` can run once per process, but a trainer holds several update
groups at once and rebuilds them when members change. A group here is a TCPStore at
tcp://master_address:master_port, a PrefixStore per group name, and a backend built on it (as SGLang's
`init_custom_process_group` does, so a real SGLang engine joins as a plain store client).

Rank 0 hosts the TCPStore. Master stores are pooled per (address, port) and reference-counted: a
successor group on the same port (e.g. the next rollout's actor_fwd group) reuses the live store instead
of binding the port again while the old listener may linger.

Readiness comes only from what SGLang's protocol itself does, so that a real SGLang engine and `dcs receiver`
behave alike (neither writes anything else to the store): gloo's constructor connects the full mesh, so rank
0's `new_group` returns only once every rank connected to it (bounded by `new_group_within`). NCCL connects
lazily, and SGLang runs no collective when it joins (`init_custom_process_group` passes no device id), so an
NCCL group is proven only by its first collective: the trainer then relies on every engine's join answer
(SGLang answers success only after its rank built the group) and on the first broadcast, which is bounded by
the group timeout (`comm_timeout_seconds`) and fails naming the group's members. NCCL was not run here (no GPU).
"""

from __future__ import annotations

import inspect
import threading
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from dcs_tasks.backends.base import GroupSpec
from dcs_tasks.errors import TorchInternalsMissing

# What of torch.distributed.distributed_c10d this module uses beyond the public API: the group builder behind
# `new_group` (called without a default group, with these keywords) and the registry of groups' ranks.
HELPER = "_new_process_group_helper"
HELPER_KEYWORDS = ("group_name", "timeout")
ATTRIBUTES = ("PrefixStore", "Backend", "GroupName", HELPER, "_world")


def missing_torch_internals() -> list[str]:
    """The c10d internals this module needs that the installed torch lacks (empty when all are there)."""
    missing = [f"distributed_c10d.{name}" for name in ATTRIBUTES if not hasattr(c10d, name)]
    helper = getattr(c10d, HELPER, None)
    if callable(helper):
        try:
            names = set(inspect.signature(helper).parameters)
        except (TypeError, ValueError):  # a builtin without a signature: its keywords cannot be checked
            names = set(HELPER_KEYWORDS)
        missing += [f"distributed_c10d.{HELPER}({k}=...)" for k in HELPER_KEYWORDS if k not in names]
    elif helper is not None:
        missing.append(f"distributed_c10d.{HELPER} (not callable)")
    world = getattr(c10d, "_world", None)
    if world is not None and not isinstance(getattr(world, "pg_group_ranks", None), dict):
        missing.append("distributed_c10d._world.pg_group_ranks (a dict)")
    return missing


def check_torch_internals() -> None:
    """Raise TorchInternalsMissing naming torch's version and each missing internal; run when this module is
    imported, so an unsupported torch fails at start-up instead of at the first weight update."""
    missing = missing_torch_internals()
    if missing:
        raise TorchInternalsMissing(
            f"torch {torch.__version__} lacks {', '.join(missing)}, which DCS's weight-update groups use "
            "(dcs_tasks/backends/process_group.py); install a torch DCS supports (torch>=2.13, docs/testing.md)"
        )


check_torch_internals()

_MASTERS: dict[tuple[str, int], tuple[dist.TCPStore, int]] = {}
_MASTERS_LOCK = threading.Lock()


def _store(address: str, port: int, rank: int, timeout: timedelta) -> dist.Store:
    if rank != 0:
        return dist.TCPStore(address, port, is_master=False, timeout=timeout, wait_for_workers=False)
    with _MASTERS_LOCK:
        store, refs = _MASTERS.get((address, port), (None, 0))
        if store is None:
            store = dist.TCPStore(address, port, is_master=True, timeout=timeout, wait_for_workers=False)
        _MASTERS[(address, port)] = (store, refs + 1)
        return store


def release_store(address: str, port: int) -> None:
    """Drop one reference to the master store on address:port; the last one closes it."""
    with _MASTERS_LOCK:
        store, refs = _MASTERS.get((address, port), (None, 0))
        if store is None:
            return
        if refs <= 1:
            del _MASTERS[(address, port)]
        else:
            _MASTERS[(address, port)] = (store, refs - 1)


def new_group(
    backend: str,
    master_address: str,
    master_port: int,
    world_size: int,
    rank: int,
    group_name: str,
    init_timeout_seconds: float,
    timeout_seconds: float,
) -> dist.ProcessGroup:
    """Rendezvous and build the group. Raises whatever torch raises (DistStoreError, RuntimeError)."""
    init_timeout = timedelta(seconds=init_timeout_seconds)
    store = _store(master_address, master_port, rank, init_timeout)
    try:
        prefixed = c10d.PrefixStore(group_name, store)
        pg, _ = c10d._new_process_group_helper(
            world_size,
            rank,
            [],
            c10d.Backend(backend),
            prefixed,
            group_name=c10d.GroupName(group_name),
            timeout=timedelta(seconds=timeout_seconds),
        )
    except BaseException:
        if rank == 0:
            release_store(master_address, master_port)
        raise
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy(pg: dist.ProcessGroup) -> None:
    """Destroy a group built by `new_group`; errors of an already-broken group are ignored."""
    try:
        dist.destroy_process_group(pg)
    except (RuntimeError, ValueError, KeyError, AssertionError):
        c10d._world.pg_group_ranks.pop(pg, None)


def new_group_within(spec: GroupSpec, init_timeout_seconds: float, timeout_seconds: float) -> dist.ProcessGroup:
    """`new_group` for `spec`, but given up after `init_timeout_seconds` even where torch would wait for the collective
    timeout (the backend's full-mesh connect uses it). The abandoned attempt runs on in a daemon thread and
    destroys its group if it ever forms. Raises TimeoutError when the deadline passes."""
    outcome: dict[str, object] = {}
    abandoned = threading.Event()
    decided = threading.Lock()

    def attempt() -> None:
        try:
            pg = new_group(
                spec.backend.value,
                spec.master_address,
                spec.master_port,
                spec.world_size,
                spec.rank,
                spec.group_name,
                init_timeout_seconds,
                timeout_seconds,
            )
        except BaseException as exc:
            outcome["error"] = exc
            return
        with decided:
            outcome["pg"] = pg
            if not abandoned.is_set():
                return
        destroy(pg)
        if spec.rank == 0:
            release_store(spec.master_address, spec.master_port)

    thread = threading.Thread(target=attempt, name=f"dcs-join-{spec.group_name}", daemon=True)
    thread.start()
    thread.join(init_timeout_seconds + 1.0)
    with decided:
        if not outcome:
            abandoned.set()
            raise TimeoutError(f"group {spec.group_name!r} did not form within {init_timeout_seconds:g}s")
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["pg"]  # type: ignore[return-value]
