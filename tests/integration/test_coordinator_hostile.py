"""Hostile input at the coordinator's boundary (real app lifespan, real redis-server): bounded metadata,
unreadable records skipped and reported, capped weight-meta answers, bounded query integers, roles that go
with their last node, the cross-site browser guard, JSON errors everywhere."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from pydantic import SecretStr

from dcs_tasks.config import DCSConfig, RoleInfo
from dcs_tasks.keys import Keys
from dcs_tasks.models import WeightMeta
from tests.helpers.redis_server import RedisServer
from tests.integration.coordinator_support import InProcessCoordinator, in_process_coordinator

pytestmark = pytest.mark.integration


def nested(depth: int) -> dict[str, object]:
    value: dict[str, object] = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


@pytest.fixture
async def coord(dcs_config: DCSConfig) -> AsyncIterator[InProcessCoordinator]:
    async with in_process_coordinator(dcs_config) as c:
        yield c


# --- registered metadata is bounded ---------------------------------------------------------------------
async def test_deep_metadata_is_422_naming_the_limit_and_nothing_is_stored(coord: InProcessCoordinator) -> None:
    response = await coord.http.post("/register", json={"role_name": "actor", "metadata": nested(200)})
    assert response.status_code == 422
    assert "DCS_METADATA_MAX_DEPTH" in response.json()["detail"] and "16" in response.json()["detail"]
    assert (await coord.api.topology()).world_size == 0
    ok = await coord.http.post("/register", json={"role_name": "actor", "metadata": nested(16)})
    assert ok.status_code == 200  # the limit itself is allowed


async def test_a_body_nested_past_any_parser_is_a_json_400(coord: InProcessCoordinator) -> None:
    body = b'{"role_name": "a", "metadata": ' + b'{"a": ' * 100_000 + b"1" + b"}" * 100_001
    response = await coord.http.post("/register", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400 and isinstance(response.json()["detail"], str)
    assert (await coord.api.topology()).world_size == 0


async def test_large_metadata_is_422_naming_the_limit(dcs_config: DCSConfig) -> None:
    config = dcs_config.model_copy(update={"metadata_max_bytes": 1000})
    async with in_process_coordinator(config) as coord:
        response = await coord.http.post("/register", json={"role_name": "actor", "metadata": {"x": "y" * 2000}})
        assert response.status_code == 422
        assert "DCS_METADATA_MAX_BYTES" in response.json()["detail"] and "1000" in response.json()["detail"]


async def test_registering_deep_metadata_through_the_api_never_breaks_reads(coord: InProcessCoordinator) -> None:
    await coord.api.register(RoleInfo(role_name="actor", rank=0, port=1))
    await coord.http.post("/register", json={"role_name": "actor", "rank": 1, "metadata": nested(250)})
    for path in ("/topology", "/health", "/debug/topology"):
        assert (await coord.http.get(path)).status_code == 200, path


# --- a corrupt record in Redis is skipped and reported, never a 500 for everyone --------------------------
def _corrupt(redis_server: RedisServer, keys: Keys) -> None:
    """Records written past the coordinator, as a bug, an old version or an operator's hand might."""
    client = redis_server.client()
    too_deep_to_parse = json.dumps({"role_name": "actor", "rank": 3, "metadata": nested(250)})
    too_deep_to_answer = json.dumps({"role_name": "actor", "rank": 6, "metadata": nested(190)})
    records = {"2": "{not json", "3": too_deep_to_parse, "4": json.dumps({"rank": 4}), "6": too_deep_to_answer}
    client.hset(keys.role_nodes("actor"), mapping=records)
    client.hset(keys.role_nodes("rollout"), "5", json.dumps({"role_name": "actor", "rank": 9}))  # another node's
    client.set(keys.role_nodes("critic"), "a string, not a hash")
    client.zadd(keys.roles(), {"critic": 100})
    for role, rank in (("actor", 2), ("actor", 3), ("actor", 4), ("actor", 6), ("rollout", 5)):
        client.set(keys.heartbeat(role, rank), "1", px=60_000)  # "alive" as far as Redis knows


async def test_corrupt_records_are_skipped_by_every_read_and_reported_in_health(
    coord: InProcessCoordinator, redis_server: RedisServer, dcs_config: DCSConfig
) -> None:
    api, keys = coord.api, Keys(dcs_config.redis.namespace)
    await api.register(RoleInfo(role_name="actor", rank=0, port=10))
    await api.register(RoleInfo(role_name="actor", rank=1, port=11))
    await api.register(RoleInfo(role_name="rollout", rank=0, port=20))
    _corrupt(redis_server, keys)

    topo = await api.topology()
    assert {role: sorted(nodes) for role, nodes in topo.nodes.items()} == {"actor": [0, 1], "rollout": [0]}
    assert sorted((await api.topology("actor")).nodes["actor"]) == [0, 1]
    health = await api.health()
    assert health.status.value == "degraded" and health.world_size == 3
    assert health.unreadable_records == 6
    assert f"{keys.role_nodes('actor')}[2]" in health.unreadable_keys
    assert f"{keys.role_nodes('rollout')}[5]" in health.unreadable_keys
    assert any(k.startswith(keys.role_nodes("critic")) for k in health.unreadable_keys)
    assert sorted((await api.debug_topology()).nodes["actor"]) == [0, 1]
    assert (await api.node("actor", 1)).port == 11
    assert (await api.peer("actor", 0)).port == 20
    assert await api.global_rank("rollout", 0) == 2
    assert (await api.model_update_group_ranks("actor", 0)).global_rank == 0
    assert (await coord.http.get("/node", params={"role": "actor", "rank": 2})).status_code == 404
    await api.heartbeat("actor", 0)


# --- /recv_weight_meta answers are capped; the client continues from next_index ---------------------------
def meta(i: int, names: int = 35) -> WeightMeta:
    return WeightMeta(
        names=[f"layer{i}.w{j}" for j in range(names)],
        dtypes=["float32"] * names,
        shapes=[[4, 4]] * names,
        group_name="g",
    )


@pytest.fixture
async def capped(dcs_config: DCSConfig) -> AsyncIterator[InProcessCoordinator]:
    limits = {
        "weight_meta_read_max_entries": 5,
        "weight_meta_read_max_bytes": 4096,
        "weight_meta_entry_max_bytes": 2048,
    }
    async with in_process_coordinator(dcs_config.model_copy(update=limits)) as c:
        yield c


async def test_a_read_is_capped_in_bytes_and_entries_and_the_client_follows_next_index(
    capped: InProcessCoordinator,
) -> None:
    sent = [meta(i) for i in range(12)] + [WeightMeta.end()]
    for entry in sent:
        await capped.api.send_weight_meta(entry)
    size = len(sent[0].model_dump_json())
    assert 1000 < size < 2048
    first = await capped.api.recv_weight_meta(0)
    assert 1 <= len(first.entries) <= 4096 // size and first.more
    assert (first.first_index, first.next_index, first.end_index) == (0, len(first.entries), 13)
    assert first.entries == sent[: len(first.entries)]
    whole = await capped.api.recv_weight_meta_all(0)
    assert whole.entries == sent and whole.next_index == 13 and not whole.more
    assert await capped.api.weight_meta_end() == 13
    small = [WeightMeta.end()] * 7
    for entry in small:
        await capped.api.send_weight_meta(entry)
    by_count = await capped.api.recv_weight_meta(13)
    assert len(by_count.entries) == 5 and by_count.next_index == 18  # the entry cap
    assert (await capped.api.recv_weight_meta(13, limit=2)).next_index == 15


async def test_an_oversized_weight_meta_entry_is_413_naming_the_limit(capped: InProcessCoordinator) -> None:
    response = await capped.http.post("/send_weight_meta", json=meta(0, names=200).model_dump(mode="json"))
    assert response.status_code == 413
    assert "DCS_WEIGHT_META_ENTRY_MAX_BYTES" in response.json()["detail"]
    assert await capped.api.weight_meta_end() == 0


@pytest.mark.parametrize(
    "params",
    [{"index": 2**63}, {"index": 2**64 + 5}, {"index": -1}, {"limit": -1}, {"limit": 10**9}, {"wait_timeout_s": -1}],
)
async def test_query_integers_out_of_range_are_422(coord: InProcessCoordinator, params: dict[str, int]) -> None:
    response = await coord.http.get("/recv_weight_meta", params=params)
    assert response.status_code == 422, response.text
    assert next(iter(params)) in response.json()["detail"]


async def test_the_largest_index_answers_an_empty_batch(coord: InProcessCoordinator) -> None:
    await coord.api.send_weight_meta(WeightMeta.end())
    batch = await coord.api.recv_weight_meta(2**53 - 1)
    assert batch.entries == [] and batch.end_index == 1 and not batch.more


# --- roles go with their last node -------------------------------------------------------------------------
async def test_a_role_is_removed_when_its_last_node_unregisters(coord: InProcessCoordinator) -> None:
    for i in range(30):
        await coord.api.register(RoleInfo(role_name=f"r{i}", rank=0, port=1000 + i))
    await coord.api.register(RoleInfo(role_name="keep", rank=0, port=1))
    await coord.api.register(RoleInfo(role_name="keep", rank=1, port=2))
    for i in range(30):
        await coord.api.unregister(f"r{i}", 0)
    await coord.api.unregister("keep", 1)
    assert (await coord.api.debug_topology()).roles == ["keep"]
    await coord.api.register(RoleInfo(role_name="r3", rank=0, port=3))  # comes back, at the end of the order
    assert (await coord.api.debug_topology()).roles == ["keep", "r3"]


async def test_roles_left_without_nodes_by_older_data_are_pruned(
    coord: InProcessCoordinator, redis_server: RedisServer, dcs_config: DCSConfig
) -> None:
    keys = Keys(dcs_config.redis.namespace)
    await coord.api.register(RoleInfo(role_name="live", rank=0, port=1))
    redis_server.client().zadd(keys.roles(), {f"gone{i}": 100 + i for i in range(1200)})  # no node records
    topology = coord.app.state.services.topology
    for _ in range(4):  # one bounded slice per call
        await topology.prune_empty_roles()
    assert (await coord.api.debug_topology()).roles == ["live"]


async def test_long_dead_nodes_and_their_roles_are_swept(dcs_config: DCSConfig) -> None:
    config = dcs_config.model_copy(
        update={"heartbeat_interval_seconds": 0.2, "heartbeat_timeout_seconds": 1.0, "dead_node_retention_seconds": 1.0}
    )
    async with in_process_coordinator(config) as coord:
        await coord.api.register(RoleInfo(role_name="ghost", rank=0, port=1))
        await coord.api.register(RoleInfo(role_name="live", rank=0, port=2))
        deadline = asyncio.get_running_loop().time() + 15
        while (roles := (await coord.api.debug_topology()).roles) != ["live"]:
            assert asyncio.get_running_loop().time() < deadline, roles
            await coord.api.heartbeat("live", 0)
            await asyncio.sleep(0.1)
        assert (await coord.api.health()).dead_nodes == []
        ghost: dict[str, str | int] = {"role": "ghost", "rank": 0}
        named = {"X-DCS-Node": "10.9.9.9:1"}  # beats carry an identity (issue 20, finding 11)
        assert (await coord.http.get("/heartbeat", params=ghost, headers=named)).status_code == 404


# --- state-changing GET, cross-site browsers, JSON errors --------------------------------------------------
@pytest.mark.parametrize(
    "headers",
    [{"Sec-Fetch-Site": "cross-site"}, {"Sec-Fetch-Site": "same-site"}, {"Origin": "http://evil.example"}],
)
async def test_without_a_token_a_cross_site_browser_cannot_clear_the_log(
    coord: InProcessCoordinator, headers: dict[str, str]
) -> None:
    await coord.api.send_weight_meta(WeightMeta.end())
    for method in ("GET", "POST"):
        refused = await coord.http.request(method, "/clear_weight_meta", headers=headers)
        assert refused.status_code == 403 and "cross-site" in refused.json()["detail"]
    assert await coord.api.weight_meta_end() == 1 and len((await coord.api.recv_weight_meta(0)).entries) == 1


async def test_clear_weight_meta_by_post_and_by_the_seeds_get(coord: InProcessCoordinator) -> None:
    await coord.api.send_weight_meta(WeightMeta.end())
    assert (await coord.api.clear_weight_meta()).cleared == 1  # POST
    await coord.api.send_weight_meta(WeightMeta.end())
    same_origin = {"Origin": "http://coordinator", "Sec-Fetch-Site": "same-origin"}  # e.g. the /docs page
    answer = await coord.http.get("/clear_weight_meta", headers=same_origin)
    assert answer.status_code == 200 and answer.json()["cleared"] == 1


async def test_with_a_token_the_get_needs_it(dcs_config: DCSConfig) -> None:
    async with in_process_coordinator(dcs_config.model_copy(update={"auth_token": SecretStr("tok-abc")})) as coord:
        assert (await coord.http.get("/clear_weight_meta")).status_code == 401
        good = await coord.http.get("/clear_weight_meta", headers={"Authorization": "Bearer tok-abc"})
        assert good.status_code == 200


async def test_unknown_paths_and_methods_answer_json(coord: InProcessCoordinator) -> None:
    for method, path, status in (("GET", "/nope", 404), ("PUT", "/topology", 405), ("DELETE", "/register", 405)):
        answer = await coord.http.request(method, path)
        assert answer.status_code == status
        assert answer.headers["content-type"] == "application/json" and isinstance(answer.json()["detail"], str)


async def test_every_422_detail_is_a_string_as_documented(coord: InProcessCoordinator) -> None:
    schema = (await coord.http.get("/openapi.json")).json()
    documented = schema["paths"]["/register"]["post"]["responses"]["422"]["content"]["application/json"]["schema"]
    assert documented == {"$ref": "#/components/schemas/ErrorResponse"}
    assert schema["components"]["schemas"]["ErrorResponse"]["properties"]["detail"]["type"] == "string"
    for path, codes in {"/heartbeat": {"get": {"404", "409", "401", "503"}}, "/register": {"post": {"413"}}}.items():
        for method, wanted in codes.items():
            assert wanted <= set(schema["paths"][path][method]["responses"]), (path, method)
    answer = await coord.http.get("/heartbeat", params={"role": "actor"})
    assert answer.status_code == 422 and isinstance(answer.json()["detail"], str)


async def test_the_redis_pool_is_bounded_and_waits_instead_of_failing(dcs_config: DCSConfig) -> None:
    import redis.asyncio as aioredis

    config = dcs_config.model_copy(update={"redis_max_connections": 8, "redis_pool_timeout_seconds": 5.0})
    async with in_process_coordinator(config) as coord:
        pool = coord.app.state.services.redis.connection_pool
        assert isinstance(pool, aioredis.BlockingConnectionPool) and pool.max_connections == 8
        answers = await asyncio.gather(*[coord.http.get("/topology") for _ in range(100)])  # 100 reads, 8 connections
        assert [a.status_code for a in answers] == [200] * 100
