"""Named torch.distributed groups without a default process group.

`torch.distributed.init_process_group` can run once per process, but a trainer holds several update
groups at once and a receiver rebuilds its group when members change. This creates a standalone group
the way SGLang's `init_custom_process_group` does (TCPStore rendezvous at tcp://addr:port, a PrefixStore
per group name), so a real SGLang engine and our processes rendezvous identically.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


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
    init_url = f"tcp://{master_address}:{master_port}"
    rendezvous = c10d.rendezvous(init_url, rank, world_size, timeout=timedelta(seconds=init_timeout_seconds))
    store, rank, world_size = next(rendezvous)
    store.set_timeout(timedelta(seconds=init_timeout_seconds))
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
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy(pg: dist.ProcessGroup) -> None:
    """Destroy a group built by `new_group`; errors of an already-broken group are ignored."""
    try:
        dist.destroy_process_group(pg)
    except (RuntimeError, ValueError, KeyError, AssertionError):
        c10d._world.pg_group_ranks.pop(pg, None)
