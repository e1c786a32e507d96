"""TopologyManager and WeightMetaStore used directly (as an embedding service would), on a real redis-server."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from coordinator.app import make_redis
from coordinator.topology import RegistrationKind, TopologyManager
from dcs_tasks.config import DCSConfig, RoleInfo, TopologyConfig
from dcs_tasks.keys import Keys
from tests.helpers.redis_server import RedisServer

pytestmark = pytest.mark.integration


@pytest.fixture
async def manager(dcs_config: DCSConfig) -> AsyncIterator[TopologyManager]:
    client = make_redis(dcs_config)
    mappings = {"actor": "rollout", "critic": "actor"}
    yield TopologyManager(client, Keys(dcs_config.redis.namespace), TopologyConfig(role_mappings=mappings), 5.0)
    await client.aclose()


async def test_manager_api_of_the_seed(manager: TopologyManager) -> None:
    first = await manager.register(RoleInfo(role_name="actor", ip="10.0.0.1", port=1))
    assert first.rank == 0 and first.kind is RegistrationKind.ASSIGNED
    again = await manager.register(RoleInfo(role_name="actor", ip="10.0.0.1", port=1))
    assert again.kind is RegistrationKind.REREGISTERED and again.rank == 0
    await manager.register(RoleInfo(role_name="rollout", rank=0, port=2))
    await manager.register(RoleInfo(role_name="critic", rank=0, port=3))
    assert (await manager.get_peer("actor", 0)) == await manager.get_node("rollout", 0)
    assert sorted(await manager.get_all_peers("actor", 0)) == ["critic", "rollout"]
    assert await manager.get_world_size() == 3 and await manager.get_world_size("actor") == 1
    assert await manager.get_global_rank("critic", 0) == 2
    assert list(await manager.get_role_nodes("actor")) == [0]
    assert set(await manager.get_all_nodes()) == {"actor", "rollout", "critic"}
    assert await manager.heartbeat("actor", 0) is not None and await manager.heartbeat("actor", 1) is None
    dump = await manager.to_dict()
    assert dump["roles"] == ["actor", "rollout", "critic"]
    assert await manager.unregister("critic", 0) and not await manager.unregister("critic", 0)
    assert (await manager.check_health()).dead_node_ids() == []


@pytest.mark.own_redis
async def test_topology_survives_redis_kill_9_with_aof(manager: TopologyManager, redis_server: RedisServer) -> None:
    for port in range(1, 4):
        await manager.register(RoleInfo(role_name="rollout", port=port))
    redis_server.kill()  # no shutdown: only what appendfsync-always AOF has survives
    redis_server.start()
    assert sorted(await manager.get_role_nodes("rollout")) == [0, 1, 2]
    assert (await manager.register(RoleInfo(role_name="rollout", port=2))).rank == 1


async def test_a_retried_weight_meta_append_is_stored_once(dcs_config: DCSConfig) -> None:
    from coordinator.weight_meta import AppendNotifier, WeightMetaStore
    from dcs_tasks.models import WeightMeta

    client = make_redis(dcs_config)
    keys = Keys(dcs_config.redis.namespace)
    store = WeightMetaStore(client, keys, AppendNotifier(client, keys.weight_meta_channel()))
    try:
        meta = WeightMeta(names=["w"], dtypes=["float32"], shapes=[[2]], group_name="g")
        assert await store.append(meta, append_id="req-1") == 1
        assert await store.append(meta, append_id="req-1") == 1  # what redis-py does after a lost reply
        assert await store.append(WeightMeta.end()) == 2
        assert (await store.read(0)).entries == [meta, WeightMeta.end()]
    finally:
        await client.aclose()
