"""The coordinator's endpoint semantics, in-process (real lifespan) against a real redis-server."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import pytest

from dcs_tasks.config import DCSConfig, RoleInfo, TopologyConfig
from dcs_tasks.errors import CoordinatorError, NodeNotFound
from dcs_tasks.keys import Keys
from dcs_tasks.models import HealthStatus, WeightMeta
from tests.helpers.redis_server import RedisServer
from tests.helpers.waiting import eventually
from tests.integration.coordinator_support import InProcessCoordinator, in_process_coordinator

pytestmark = pytest.mark.integration


@pytest.fixture
async def coord(dcs_config: DCSConfig) -> AsyncIterator[InProcessCoordinator]:
    async with in_process_coordinator(dcs_config) as c:
        yield c


def node(role: str, rank: int | None = None, port: int = 0, **metadata: object) -> RoleInfo:
    return RoleInfo(role_name=role, rank=rank, ip="10.0.0.1", port=port, metadata=dict(metadata))


async def test_register_assigns_explicit_smallest_free_and_kept_ranks(coord: InProcessCoordinator) -> None:
    api = coord.api
    explicit = await api.register(node("actor", rank=2, port=5002))
    assert (explicit.rank, explicit.node_id) == (2, "actor_2")
    first = await api.register(node("actor", port=5000))
    second = await api.register(node("actor", port=5001))
    assert (first.rank, second.rank) == (0, 1)
    again = await api.register(node("actor", port=5000))  # same role + ip + port
    assert again.rank == 0
    assert (await api.register(node("actor", port=5003))).rank == 3
    topo = await api.topology()
    assert sorted(topo.nodes["actor"]) == [0, 1, 2, 3] and topo.world_size == 4
    assert topo.nodes["actor"][1].port == 5001


async def test_node_moving_to_an_explicit_rank_releases_its_old_rank(coord: InProcessCoordinator) -> None:
    api = coord.api
    await api.register(node("actor", rank=0, port=6000))
    await api.register(node("actor", rank=3, port=6000))
    assert sorted((await api.topology("actor")).nodes["actor"]) == [3]


async def test_hundred_concurrent_registrations_through_two_apps_get_distinct_ranks(dcs_config: DCSConfig) -> None:
    async with in_process_coordinator(dcs_config) as a, in_process_coordinator(dcs_config) as b:
        calls = [(a if i % 2 else b).api.register(node("rollout", port=7000 + i)) for i in range(100)]
        answers = await asyncio.gather(*calls)
        assert sorted(r.rank for r in answers) == list(range(100))
        assert (await a.api.topology("rollout")).world_size == 100


async def test_unknown_node_is_404_everywhere(coord: InProcessCoordinator) -> None:
    api = coord.api
    for call in (
        api.heartbeat("actor", 0, ip="10.0.0.9", port=9),  # beats and unregisters carry an identity
        api.node("actor", 0),
        api.peer("actor", 0),
        api.global_rank("actor", 0),
        api.model_update_group_ranks("actor", 0),
    ):
        with pytest.raises(NodeNotFound, match=r"(actor|rollout)_0"):
            await call
    fenced = {"X-DCS-Node": "10.0.0.9:9"}
    gone = await coord.authed.delete("/unregister", params={"role": "actor", "rank": 0}, headers=fenced)
    assert gone.status_code == 404 and "actor_0" in gone.json()["detail"]


async def test_unregister_removes_node(coord: InProcessCoordinator) -> None:
    await coord.api.register(node("actor", rank=0))
    await coord.api.unregister("actor", 0)
    with pytest.raises(NodeNotFound):
        await coord.api.node("actor", 0)
    assert (await coord.api.health()).world_size == 0


async def test_heartbeat_expiry_drops_node_and_health_lists_it(dcs_config: DCSConfig) -> None:
    config = dcs_config.model_copy(update={"heartbeat_interval_seconds": 0.1, "heartbeat_timeout_seconds": 1.5})
    async with in_process_coordinator(config) as c:
        await c.api.register(node("actor", rank=0, port=1))
        await c.api.register(node("rollout", rank=0, port=2))
        assert (await c.api.peer("actor", 0)).port == 2
        deadline = asyncio.get_running_loop().time() + 15
        while True:  # the actor keeps beating (well within its TTL, even on a loaded machine), the rollout does not
            await asyncio.sleep(0.2)
            await c.api.heartbeat("actor", 0)
            health = await c.api.health()
            if health.dead_nodes or asyncio.get_running_loop().time() > deadline:
                break
        assert health.status is HealthStatus.DEGRADED and health.dead_nodes == ["rollout_0"]
        assert health.world_size == 1
        topo = await c.api.topology()
        assert "rollout" not in topo.nodes or topo.nodes["rollout"] == {}
        with pytest.raises(NodeNotFound, match="rollout_0"):
            await c.api.peer("actor", 0)
        await c.api.heartbeat("rollout", 0)  # a registered node that beats again is alive again
        assert (await c.api.health()).status is HealthStatus.HEALTHY


async def test_dead_nodes_rank_is_reused_by_a_new_node(dcs_config: DCSConfig) -> None:
    config = dcs_config.model_copy(update=KILL_ONE_BEATS)
    async with in_process_coordinator(config) as c:
        await c.api.register(node("rollout", port=1))
        await c.api.register(node("rollout", port=2))
        await _kill_one(c, ("rollout", 0), [("rollout", 0), ("rollout", 1)])  # rank 0 expired, rank 1 alive
        replacement = await c.api.register(node("rollout", port=3))
        assert replacement.rank == 0
        assert (await c.api.node("rollout", 0)).port == 3


async def test_peer_uses_mapping_or_explicit_role(coord: InProcessCoordinator) -> None:
    api = coord.api
    await api.register(node("actor", rank=1, port=1))
    await api.register(node("rollout", rank=1, port=2))
    await api.register(node("critic", rank=1, port=3))
    assert (await api.peer("actor", 1)).port == 2
    assert (await api.peer("actor", 1, peer_role="critic")).port == 3
    with pytest.raises(NodeNotFound, match="no peer role mapping"):
        await api.peer("critic", 1)


async def test_global_rank_follows_registration_order(coord: InProcessCoordinator) -> None:
    api = coord.api
    for rank in range(2):
        await api.register(node("actor", rank=rank, port=10 + rank))
    for rank in range(3):
        await api.register(node("rollout", rank=rank, port=20 + rank))
    assert [await api.global_rank("actor", r) for r in range(2)] == [0, 1]
    assert [await api.global_rank("rollout", r) for r in range(3)] == [2, 3, 4]


async def test_global_rank_follows_configured_role_order(dcs_config: DCSConfig) -> None:
    topology = TopologyConfig(role_order=["rollout", "actor"])
    async with in_process_coordinator(dcs_config, topology) as c:
        await c.api.register(node("actor", rank=0, port=1))
        for rank in range(3):
            await c.api.register(node("rollout", rank=rank, port=20 + rank))
        assert await c.api.global_rank("actor", 0) == 3
        assert await c.api.global_rank("rollout", 2) == 2


# a TTL that the nodes `_kill_one` keeps alive outlast on a loaded 2-core machine (1.0 s did not: a round of five
# beats and a health read once took longer, and a kept node showed dead beside the expired one)
KILL_ONE_BEATS = {"heartbeat_interval_seconds": 0.1, "heartbeat_timeout_seconds": 2.5}


async def _kill_one(c: InProcessCoordinator, dead: tuple[str, int], nodes: list[tuple[str, int]]) -> None:
    """Let `dead` expire (its heartbeat TTL) while every other node of `nodes` keeps beating (bounded wait)."""

    async def expired() -> bool:
        for role, rank in nodes:
            if (role, rank) != dead:
                await c.api.heartbeat(role, rank)
        return bool((await c.api.health()).dead_nodes)

    await eventually(expired, 30, f"{dead[0]}_{dead[1]}'s heartbeat to expire", interval=0.1)
    assert (await c.api.health()).dead_nodes == [f"{dead[0]}_{dead[1]}"]


async def test_a_dead_nodes_gap_never_makes_global_ranks_collide(dcs_config: DCSConfig) -> None:
    config = dcs_config.model_copy(update=KILL_ONE_BEATS)
    nodes = [("actor", r) for r in range(3)] + [("rollout", r) for r in range(2)]
    async with in_process_coordinator(config) as c:
        for i, (role, rank) in enumerate(nodes):
            await c.api.register(node(role, rank=rank, port=100 + i))
        dense = await c.api.topology()
        assert dense.world_size == dense.rank_space == 5
        assert [await c.api.global_rank(role, rank) for role, rank in nodes] == [0, 1, 2, 3, 4]
        await _kill_one(c, ("actor", 1), nodes)
        live = [n for n in nodes if n != ("actor", 1)]
        ranks = [await c.api.global_rank(role, rank) for role, rank in live]
        assert ranks == [0, 2, 3, 4]  # no shift, no collision of rollout_0 with actor_2
        topo = await c.api.topology()
        assert (topo.world_size, topo.rank_space) == (4, 5) and max(ranks) < topo.rank_space
        with pytest.raises(NodeNotFound, match="actor_1"):
            await c.api.global_rank("actor", 1)


async def test_a_dead_actor_fwd_keeps_its_group_slot(dcs_config: DCSConfig) -> None:
    config = dcs_config.model_copy(update=KILL_ONE_BEATS)
    nodes = [("actor", 0)] + [("actor_fwd", r) for r in range(3)] + [("reference", 0)]
    async with in_process_coordinator(config) as c:
        for i, (role, rank) in enumerate(nodes):
            await c.api.register(node(role, rank=rank, port=100 + i))
        await _kill_one(c, ("actor_fwd", 1), nodes)
        fwd = await c.api.model_update_group_ranks("actor_fwd", 2, need_update_ref=True)
        ref = await c.api.model_update_group_ranks("reference", 0, need_update_ref=True)
        assert (fwd.global_rank, ref.global_rank) == (3, 4)  # distinct: rank 2 of actor_fwd is not shifted
        assert fwd.world_size == ref.world_size == 5  # the dead slot is waited for, not reused by another


async def test_model_update_group_ranks(coord: InProcessCoordinator) -> None:
    api = coord.api
    src = {"is_pp_src_rank": True, "master_address": "10.1.1.1"}
    await api.register(node("actor", rank=0, port=1, pp_size=2, pp_rank=0, master_port=11000, **src))
    await api.register(node("actor", rank=1, port=2, pp_size=2, pp_rank=1, master_port=11001, **src))
    for rank in range(3):
        await api.register(node("actor_fwd", rank=rank, port=10 + rank))
    for rank in range(2):
        await api.register(node("reference", rank=rank, port=20 + rank))
    await api.register(node("rollout", rank=0, port=30))

    actor = await api.model_update_group_ranks("actor", 0, need_update_ref=True)
    assert (actor.global_rank, actor.world_size, actor.train_pp_size) == (0, 6, 2)
    assert actor.pp_groups == {"update_actor_pp_0": "tcp://10.1.1.1:11000", "update_actor_pp_1": "tcp://10.1.1.1:11001"}
    fwd = await api.model_update_group_ranks("actor_fwd", 2, need_update_ref=False)
    assert (fwd.global_rank, fwd.world_size) == (3, 4)
    ref = await api.model_update_group_ranks("reference", 1, need_update_ref=True)
    assert (ref.global_rank, ref.world_size) == (5, 6)
    with pytest.raises(CoordinatorError, match="rollout") as info:
        await api.model_update_group_ranks("rollout", 0)
    assert info.value.status_code == 400


async def test_weight_meta_append_read_by_index_and_clear(coord: InProcessCoordinator) -> None:
    api = coord.api
    metas = [WeightMeta(names=[f"w{i}"], dtypes=["float32"], shapes=[[i, 2]], group_name="g") for i in range(3)]
    for meta in metas:
        await api.send_weight_meta(meta)
    await api.send_weight_meta(WeightMeta.end())
    batch = await api.recv_weight_meta(0)
    assert batch.entries[:3] == metas and batch.entries[3].is_end and batch.next_index == 4
    assert (await api.recv_weight_meta(2)).entries[0] == metas[2]
    assert (await api.clear_weight_meta()).cleared == 4
    assert (await api.recv_weight_meta(0)).entries == []


async def test_weight_meta_log_is_bounded_and_indices_stay_absolute(
    dcs_config: DCSConfig, redis_server: RedisServer
) -> None:
    """Old entries are trimmed at append and cleared entries are gone, but every reader's index stays valid:
    a reader that fell behind is told where its entries resume instead of reading the wrong ones."""
    metas = [WeightMeta(names=[f"w{i}"], dtypes=["float32"], shapes=[[2]], group_name="g") for i in range(8)]
    async with in_process_coordinator(dcs_config.model_copy(update={"weight_meta_max_entries": 3})) as coord:
        api = coord.api
        for meta in metas[:5]:
            await api.send_weight_meta(meta)
        assert redis_server.client().llen(Keys(dcs_config.redis.namespace).weight_meta()) == 3
        behind = await api.recv_weight_meta(0)
        assert (behind.first_index, behind.entries, behind.next_index) == (2, metas[2:5], 5)
        current = await api.recv_weight_meta(4)
        assert (current.first_index, current.entries, current.next_index) == (4, [metas[4]], 5)

        waiting = asyncio.create_task(api.recv_weight_meta(5, wait_timeout_s=10))
        assert (await api.clear_weight_meta()).cleared == 3
        await api.send_weight_meta(metas[5])  # index 5 after the clear, not 0
        woken = await asyncio.wait_for(waiting, 5)
        assert (woken.first_index, woken.entries, woken.next_index) == (5, [metas[5]], 6)
        after_clear = await api.recv_weight_meta(0)
        assert (after_clear.first_index, after_clear.entries) == (5, [metas[5]])


@pytest.mark.own_redis
async def test_long_poll_wakes_on_append_without_polling_redis(
    coord: InProcessCoordinator, redis_server: RedisServer
) -> None:
    client = redis_server.client()
    client.config_resetstat()
    waiter = asyncio.create_task(coord.api.recv_weight_meta(0, wait_timeout_s=30))
    await asyncio.sleep(1.5)  # the behaviour under test: 1.5 s of waiting costs no reads of the list
    assert not waiter.done()
    lranges = int(client.info("commandstats").get("cmdstat_lrange", {}).get("calls", 0))
    assert lranges <= 2, f"long-poll read the list {lranges} times while waiting"
    start = time.monotonic()
    await coord.api.send_weight_meta(WeightMeta.end())
    batch = await asyncio.wait_for(waiter, 10)
    assert batch.entries == [WeightMeta.end()] and time.monotonic() - start < 10  # woken, not its 30 s timeout


async def test_long_poll_returns_empty_at_its_timeout(coord: InProcessCoordinator) -> None:
    start = time.monotonic()
    batch = await coord.api.recv_weight_meta(5, wait_timeout_s=0.5)
    elapsed = time.monotonic() - start
    assert batch.entries == [] and batch.next_index == 5
    assert 0.45 <= elapsed < 10  # it waited out its timeout (and not the 30 s of the HTTP client)


async def test_debug_topology_shows_dead_and_alive(coord: InProcessCoordinator) -> None:
    await coord.api.register(node("actor", rank=0, port=1))
    debug = await coord.api.debug_topology()
    view = debug.nodes["actor"][0]
    assert view.alive and view.heartbeat_ttl_ms is not None and 0 < view.heartbeat_ttl_ms <= 2000
    assert debug.roles == ["actor"] and debug.role_mappings == {"actor": "rollout"}


async def test_metrics_count_requests_by_route_template(coord: InProcessCoordinator) -> None:
    await coord.api.register(node("actor", rank=0, port=1))
    for _ in range(3):
        await coord.api.heartbeat("actor", 0)
    with pytest.raises(NodeNotFound):
        await coord.api.heartbeat("actor", 9, ip="10.0.0.9", port=9)
    text = (await coord.http.get("/metrics")).text
    assert 'dcs_coordinator_requests_total{method="GET",route="/heartbeat",status="200"} 3.0' in text
    assert 'dcs_coordinator_requests_total{method="GET",route="/heartbeat",status="404"} 1.0' in text
    assert 'dcs_coordinator_request_duration_seconds_count{method="GET",route="/heartbeat",status="200"} 3.0' in text


async def test_metrics_also_export_the_process_collector_once_per_family(coord: InProcessCoordinator) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from dcs_tasks.metrics import get_metrics

    get_metrics().record_error("coordinator-export-check")
    await coord.api.healthz()
    text = (await coord.http.get("/metrics")).text
    assert 'dcs_errors_total{error_type="coordinator-export-check"} 1.0' in text
    names = [family.name for family in text_string_to_metric_families(text)]
    assert len(names) == len(set(names)), "a metric family is exported twice"
    assert {"dcs_coordinator_requests", "dcs_save_latency_seconds", "dcs_pending_operations"} <= set(names)


async def test_replaced_node_gets_rank_conflict_and_its_heartbeat_loop_stops(dcs_config: DCSConfig) -> None:
    from dcs_tasks.errors import RankConflict
    from dcs_tasks.heartbeats import HeartbeatLoop

    config = dcs_config.model_copy(update={"heartbeat_interval_seconds": 0.1, "heartbeat_timeout_seconds": 0.3})
    async with in_process_coordinator(config) as c:
        old = node("rollout", port=1)
        await c.api.register(old)
        await eventually(lambda: _dead(c), 15, "rollout_0's heartbeat TTL to run out")  # presumed dead
        assert (await c.api.register(node("rollout", port=2))).rank == 0  # the replacement takes rank 0
        with pytest.raises(RankConflict, match="rollout_0") as info:
            await c.api.heartbeat("rollout", 0, ip="10.0.0.1", port=1)
        assert info.value.status_code == 409
        await c.api.heartbeat("rollout", 0, ip="10.0.0.1", port=2)  # the holder beats fine
        loop = HeartbeatLoop(c.api, old.model_copy(update={"rank": 0}), interval=0.05).start()
        await eventually(lambda: loop.lost, 15, "the loop to stop on the conflict")
        assert isinstance(loop.lost, RankConflict) and loop.beats == 0
        await loop.stop()
        held = (await c.api.debug_topology()).nodes["rollout"][0].info  # dead or alive: the old node did not
        assert held.port == 2  # take the rank back


async def test_a_portless_node_is_fenced_by_the_identity_its_registration_got(dcs_config: DCSConfig) -> None:
    import httpx

    from dcs_tasks.coordinator_api import CoordinatorAPI
    from dcs_tasks.errors import RankConflict
    from dcs_tasks.heartbeats import HeartbeatLoop

    config = dcs_config.model_copy(update={"heartbeat_interval_seconds": 0.1, "heartbeat_timeout_seconds": 0.3})
    async with in_process_coordinator(config) as c:
        assert (await c.api.register(node("actor", port=5000))).identity == "10.0.0.1:5000"
        old = await c.api.register(node("trainer"))  # port 0: no address to tell two trainers apart
        assert old.rank == 0 and old.identity.startswith("anon:")
        await eventually(lambda: _dead(c), 15, "trainer_0's heartbeat TTL to run out")  # presumed dead
        transport = httpx.ASGITransport(app=c.app)
        async with CoordinatorAPI("http://coordinator", transport=transport) as other_host:
            new = await other_host.register(node("trainer"))
            assert new.rank == 0 and new.identity != old.identity
            with pytest.raises(RankConflict, match="trainer_0"):
                await c.api.heartbeat("trainer", 0)  # the old node's client sends its identity unasked
            loop = HeartbeatLoop(c.api, node("trainer", rank=0), interval=0.05).start()
            await eventually(lambda: loop.lost, 15, "the loop to stop on the conflict")
            assert isinstance(loop.lost, RankConflict) and loop.beats == 0
            await loop.stop()
            await other_host.heartbeat("trainer", 0)  # the holder beats fine
            with pytest.raises(RankConflict, match="trainer_0"):
                await c.api.unregister("trainer", 0)  # shutting down, the old node must not remove its successor
            await other_host.heartbeat("trainer", 0)
            await other_host.unregister("trainer", 0)


async def test_a_closed_client_is_a_typed_error_and_ends_its_heartbeat_loops_quietly(
    dcs_config: DCSConfig, caplog: pytest.LogCaptureFixture
) -> None:
    """Closing a CoordinatorAPI under running heartbeat loops (an owner that forgot to stop them) ends them
    with a log line, not an unretrieved task exception; any other call says the client was closed."""
    import httpx

    from dcs_tasks.coordinator_api import CoordinatorAPI
    from dcs_tasks.errors import ClientClosed
    from dcs_tasks.heartbeats import FleetHeartbeatLoop, HeartbeatLoop

    async with in_process_coordinator(dcs_config) as c:
        api = CoordinatorAPI("http://coordinator", transport=httpx.ASGITransport(app=c.app))
        one = await api.register(node("trainer", port=7000))
        two = await api.register(node("trainer", port=7001))
        single = HeartbeatLoop(api, node("trainer", port=7000, rank=one.rank), interval=0.05).start()
        fleet = FleetHeartbeatLoop(api, [node("trainer", port=7001, rank=two.rank)], interval=0.05).start()
        await eventually(lambda: single.beats and fleet.beats, 15, "both loops to beat")
        with caplog.at_level(logging.INFO, logger="dcs_tasks.heartbeats"):
            await api.aclose()
            await eventually(lambda: not single.running and not fleet.running, 5, "both loops to end")
        assert single.lost is None and fleet.lost == [] and not single.failures and not fleet.failures
        assert "heartbeats of trainer_0 stopped: the coordinator client was closed" in caplog.text
        assert "fleet heartbeats stopped: the coordinator client was closed" in caplog.text
        with pytest.raises(ClientClosed, match="was closed"):
            await api.topology()


async def test_issued_identity_header_is_validated(coord: InProcessCoordinator) -> None:
    reg = await coord.api.register(node("trainer"))
    params: dict[str, str | int] = {"role": "trainer", "rank": reg.rank}
    ok = await coord.http.get("/heartbeat", params=params, headers={"X-DCS-Node": reg.identity})
    assert ok.status_code == 200
    other = await coord.http.get("/heartbeat", params=params, headers={"X-DCS-Node": "anon:" + "0" * 16})
    assert other.status_code == 409 and "trainer_0" in other.json()["detail"]
    bad = await coord.http.get("/heartbeat", params=params, headers={"X-DCS-Node": "anon:xyz"})
    assert bad.status_code == 422 and "X-DCS-Node" in bad.json()["detail"]


async def _dead(c: InProcessCoordinator) -> list[str]:
    return (await c.api.health()).dead_nodes
