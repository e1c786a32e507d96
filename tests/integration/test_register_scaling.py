"""Rank-less registrations stay cheap however many dead nodes there are (real redis-server).

A node registered without a rank takes the smallest rank of its role that is unregistered or whose node is dead.
The search for dead ranks used to walk every stale last-beat entry of every role, so 20,480 registrations
that never beat made each later rank-less registration of any role slow (quadratic: 20,480 rank-less
registrations took ~15 s of Redis). It now looks only at its own role's dead candidates, each once, in a
per-role index of last beats that old data, hostile records and corrupt keys do not break."""

from __future__ import annotations

import json
import time

import pytest
import redis

from coordinator.app import make_redis
from coordinator.topology import TopologyManager
from dcs_tasks.config import DCSConfig, RoleInfo, TopologyConfig
from dcs_tasks.keys import Keys
from tests.helpers.waiting import eventually

pytestmark = pytest.mark.integration

_TTL_S = 3.0  # the dead role's heartbeat timeout: its nodes die, and their last beats age past half of it, quickly
_DEAD = 20_000
_BATCH = 2_000
_ROUNDS = 3


def node(rank: int | None, port: int, role: str) -> RoleInfo:
    return RoleInfo(role_name=role, rank=rank, ip="10.0.0.1", port=port)


async def test_rankless_registrations_cost_the_same_beside_20000_dead_nodes_of_another_role(
    dcs_config: DCSConfig,
) -> None:
    client = make_redis(dcs_config)
    namespace = dcs_config.redis.namespace
    keys = Keys(namespace)
    topology = TopologyManager(client, keys, TopologyConfig(), _TTL_S)
    # the same registrations where nothing is dead (another namespace on the same Redis, nobody expires there)
    quiet = TopologyManager(client, Keys(namespace + "-quiet"), TopologyConfig(), 60.0)
    r = redis.Redis.from_url(dcs_config.redis.url, decode_responses=True)

    # 20,000 registrations of role "gone" that never beat
    await topology.register_many([node(rank, 20_000 + rank, "gone") for rank in range(_DEAD)])
    beats = [keys.heartbeat("gone", rank) for rank in range(_DEAD)]

    def all_dead() -> bool:
        return not any(r.exists(*beats[i : i + 1000]) for i in range(0, _DEAD, 1000))

    await eventually(all_dead, 30, f"the heartbeat timeout ({_TTL_S} s) of {_DEAD} nodes to run out")

    async def rankless(manager: TopologyManager, role: str, first: int = 0) -> float:
        """Time `_BATCH` rank-less registrations of new nodes (ports not used before in `role`)."""
        start = time.perf_counter()
        regs = await manager.register_many([node(None, 40_000 + first + i, role) for i in range(_BATCH)])
        took = time.perf_counter() - start
        assert [g.rank for g in regs] == list(range(first, first + _BATCH))
        return took

    quiet_s, beside_s = [], []
    for i in range(_ROUNDS):  # interleaved, each round a new role: both see the same load on a shared machine
        quiet_s.append(await rankless(quiet, f"fresh{i}"))
        beside_s.append(await rankless(topology, f"fresh{i}"))
    print(f"{_BATCH} rank-less registrations: {min(quiet_s):.3f} s alone, {min(beside_s):.3f} s beside {_DEAD} dead")
    # The old search walked every stale entry of every role: about 140x here. What is left beside the dead nodes
    # is the sweep's work on them, which shares Redis with these calls: 1x on a quiet machine, 4x once in a full
    # 4-process suite run (0.463 s against 0.117 s).
    assert min(beside_s) < 20 * min(quiet_s), (quiet_s, beside_s)

    # the dead role's own rank-less registrations still take its dead ranks, smallest first, live ones skipped,
    # and cost what the quiet ones do (the first round also sorts the 20,000 dead by rank, once)
    await topology.register_many([node(rank, 60_000 + rank, "gone") for rank in range(5)])  # 0..4 alive again
    replaced_s = []
    for i in range(_ROUNDS):
        replaced_s.append(await rankless(topology, "gone", first=5 + i * _BATCH))
        # the nodes taken so far beat, as live nodes do: under load the rounds can outlast the 3 s timeout, and a
        # registration that never beats is dead once it does
        taken = 5 + (i + 1) * _BATCH
        assert (await topology.heartbeat_many([("gone", rank, "") for rank in range(taken)]))[1] == [1] * taken
    print(f"{_BATCH} rank-less registrations taking dead ranks: {min(replaced_s):.3f} s")
    assert min(replaced_s) < 20 * min(quiet_s), (quiet_s, replaced_s)
    assert (await topology.register(node(None, 50_000, "gone"))).rank == 5 + _ROUNDS * _BATCH
    await client.aclose()
    r.close()


@pytest.mark.own_redis
async def test_the_rank_index_survives_old_data_hostile_records_and_corrupt_keys(dcs_config: DCSConfig) -> None:
    client = make_redis(dcs_config)
    keys = Keys(dcs_config.redis.namespace)
    topology = TopologyManager(client, keys, TopologyConfig(), 0.5)
    r = redis.Redis.from_url(dcs_config.redis.url, decode_responses=True)
    await topology.register_many([node(rank, 7000 + rank, "actor") for rank in range(10)])
    await topology.register_many([node(rank, 8000 + rank, "critic") for rank in range(2)])
    # records written past the scripts: fields that are no rank; the index as data from before it left it
    # (none) or corrupt (another type)
    r.hset(keys.role_nodes("actor"), mapping={"x": "{not json", "007": json.dumps({"role_name": "actor"})})
    r.delete(keys.role_beats("actor"))
    r.set(keys.role_stale("actor"), "corrupt")
    beats = [keys.heartbeat("actor", rank) for rank in range(10)] + [keys.heartbeat("critic", 1)]
    await eventually(lambda: r.exists(*beats) == 0, 15, "the heartbeat timeout (0.5 s) to run out")
    r.config_resetstat()
    ranks = [(await topology.register(node(None, 9000 + i, "actor"))).rank for i in range(11)]
    assert ranks == list(range(11))  # the dead ranks, smallest first, each once ("007" is not rank 7), then 10
    # the index was rebuilt once (one HKEYS of the role), not on every registration
    assert int(r.info("commandstats")["cmdstat_hkeys"]["calls"]) == 1

    # beats, unregistering and the sweep work beside a corrupt index of the role
    r.set(keys.role_beats("critic"), "corrupt")
    r.lpush(keys.role_stale("critic"), "corrupt")
    await topology.register(node(0, 8000, "critic"))  # alive again: 1 stays dead
    r.set(keys.role_beats("critic"), "corrupt")
    r.lpush(keys.role_stale("critic"), "corrupt")
    assert await topology.heartbeat("critic", 0, "10.0.0.1:8000") is not None
    assert (await topology.heartbeat_many([("critic", 0, "10.0.0.1:8000")]))[1] == [1]
    assert await topology.sweep_dead_nodes(0.0) >= 1
    assert r.hexists(keys.role_nodes("critic"), "0") and not r.hexists(keys.role_nodes("critic"), "1")
    assert await topology.unregister("critic", 0, "10.0.0.1:8000")
    assert (await topology.register(node(None, 8100, "critic"))).rank == 0
    await client.aclose()
    r.close()
