"""Heartbeats and registrations of many nodes: POST /heartbeats, POST /register_batch, the O(1) identity
look-up of /register, FleetHeartbeatLoop, and keep-alive across the heartbeat interval (real redis-server;
the keep-alive test on a real `dcs coordinator` process)."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis

from coordinator import scripts
from coordinator.app import make_redis
from coordinator.topology import TopologyManager
from dcs_tasks.config import DCSConfig, RoleInfo, TopologyConfig
from dcs_tasks.coordinator_api import KEEPALIVE_EXPIRY_S
from dcs_tasks.heartbeats import FleetHeartbeatLoop, HeartbeatLoop
from dcs_tasks.keys import Keys
from dcs_tasks.models import MAX_BATCH_NODES, BeatOutcome
from tests.helpers.procs import CoordinatorProcess
from tests.helpers.waiting import eventually
from tests.integration.coordinator_support import InProcessCoordinator, in_process_coordinator

pytestmark = pytest.mark.integration


@pytest.fixture
async def coord(dcs_config: DCSConfig) -> AsyncIterator[InProcessCoordinator]:
    async with in_process_coordinator(dcs_config) as c:
        yield c


def node(rank: int | None, port: int, role: str = "actor") -> RoleInfo:
    return RoleInfo(role_name=role, rank=rank, ip="10.0.0.1", port=port)


def raw_redis(config: DCSConfig) -> redis.Redis:
    return redis.Redis.from_url(config.redis.url, decode_responses=True)


async def test_batch_beats_answer_per_node_like_single_beats(
    coord: InProcessCoordinator, dcs_config: DCSConfig
) -> None:
    api, keys, r = coord.api, Keys(dcs_config.redis.namespace), raw_redis(dcs_config)
    answers = await api.register_many([node(0, 7000), node(1, 7001), node(2, 7002)])
    assert [a.rank for a in answers] == [0, 1, 2] and answers[1].identity == "10.0.0.1:7001"
    r.delete(keys.heartbeat("actor", 0))  # node 0 expired: a beat brings it back
    before = r.zscore(keys.node_beats(), "actor:1")
    # a node's first beat after its registration rewrites its last-beat records at once (its heartbeat key holds
    # the registration's mark), however long their refresh periods are
    await asyncio.sleep(0.05)
    r.delete(keys.heartbeat("actor", 2))  # rank 2's node is presumed dead: another node may take its rank
    other = await coord.authed.post("/register", json=node(2, 7999).model_dump())  # another node took rank 2
    assert other.json()["rank"] == 2  # our client's identity for rank 2 (7002) is now fenced out
    outcomes = await api.heartbeat_many([("actor", 0), ("actor", 1), ("actor", 2)])
    ok, nf, conflict = BeatOutcome.OK, BeatOutcome.NOT_FOUND, BeatOutcome.CONFLICT
    assert outcomes == [ok, ok, conflict]
    unknown = [{"role": "actor", "rank": 9, "identity": "10.0.0.1:7009"}, {"role": "nobody", "rank": 0, "identity": ""}]
    refused = await coord.authed.post("/heartbeats", json={"beats": unknown})  # every beat names its node
    assert refused.status_code == 422 and "beats.1.identity is required" in refused.json()["detail"]
    unknown[1]["identity"] = "10.0.0.1:7010"
    answer = await coord.authed.post("/heartbeats", json={"beats": unknown})
    assert answer.json()["results"] == [nf, nf]
    ttl = r.pttl(keys.heartbeat("actor", 0))
    assert 0.5 * dcs_config.heartbeat.timeout_seconds * 1000 < ttl <= dcs_config.heartbeat.timeout_seconds * 1000
    assert (r.zscore(keys.node_beats(), "actor:1") or 0) > (before or 0)  # the dead-node sweep sees the beat
    assert r.get(keys.heartbeat("actor", 9)) is None
    r.close()


async def test_batch_beats_refuse_bad_input_with_named_errors(coord: InProcessCoordinator) -> None:
    http = coord.authed  # with the token, if any
    bad_identity = {"beats": [{"role": "actor", "rank": 0, "identity": "10.0.0.1:7000"}, {"role": "a", "rank": 1,
                    "identity": "10.0.0.1:99999"}]}  # fmt: skip
    answer = await http.post("/heartbeats", json=bad_identity)
    assert answer.status_code == 422 and "beats.1.identity" in answer.json()["detail"]
    too_many = {"beats": [{"role": "actor", "rank": i} for i in range(MAX_BATCH_NODES + 1)]}
    answer = await http.post("/heartbeats", json=too_many)
    assert answer.status_code == 422 and "beats" in answer.json()["detail"]
    answer = await http.post("/heartbeats", json={"beats": [{"role": "bad role", "rank": 0}]})
    assert answer.status_code == 422 and "beats.0.role" in answer.json()["detail"]


async def test_register_batch_applies_each_registration_in_order(coord: InProcessCoordinator) -> None:
    api = coord.api
    first = await api.register_many([node(None, 7100), node(None, 7101), node(5, 7105)])
    assert [a.rank for a in first] == [0, 1, 5]
    again = await api.register_many([node(None, 7101), node(None, 7102)])  # 7101 keeps its rank
    assert [a.rank for a in again] == [1, 2] and again[0].message == "re-registered; rank kept"
    deep: dict[str, object] = {}
    for _ in range(40):
        deep = {"d": deep}
    body = {"nodes": [node(None, 7200).model_dump(), {**node(None, 7201).model_dump(), "metadata": deep}]}
    answer = await coord.authed.post("/register_batch", json=body)
    assert answer.status_code == 422 and "body.nodes.1.metadata" in answer.json()["detail"]
    assert sorted((await api.topology("actor")).nodes["actor"]) == [0, 1, 2, 5]  # nothing of the refused batch


@pytest.mark.own_redis
async def test_registering_many_nodes_does_not_scan_the_role(dcs_config: DCSConfig) -> None:
    """Each registration finds its identity's rank in O(1): no HGETALL of the owners hash (the old script
    scanned every owner on each registration, so N registrations cost O(N^2) and 10,000 took ~30 s)."""
    client = make_redis(dcs_config)
    topology = TopologyManager(client, Keys(dcs_config.redis.namespace), TopologyConfig(), 5.0)
    r = raw_redis(dcs_config)
    await topology.register_many([node(None, 8000 + i) for i in range(300)])
    r.config_resetstat()
    await topology.register_many([node(None, 8000 + i) for i in range(300, 400)])
    regs = await topology.register_many([node(None, 8000 + i) for i in (5, 250)])
    assert [g.rank for g in regs] == [5, 250]
    stats = r.info("commandstats")
    assert "cmdstat_hgetall" not in stats, stats.get("cmdstat_hgetall")
    await client.aclose()
    r.close()


@pytest.mark.own_redis
async def test_nodes_without_a_rank_get_the_smallest_free_one_without_a_scan(dcs_config: DCSConfig) -> None:
    """The smallest free rank (unregistered, or its node dead) is found without checking every rank below it:
    before, each rank-less registration scanned the role, and 5,000 of them took 16 s of Redis."""
    client = make_redis(dcs_config)
    keys = Keys(dcs_config.redis.namespace)
    topology = TopologyManager(client, keys, TopologyConfig(), 60.0)  # nobody expires while the test runs
    r = raw_redis(dcs_config)
    await topology.register_many([node(None, 8000 + i) for i in range(300)])
    r.config_resetstat()
    regs = await topology.register_many([node(None, 8300 + i) for i in range(100)])
    assert [g.rank for g in regs] == list(range(300, 400))
    assert int(r.info("commandstats")["cmdstat_hexists"]["calls"]) < 5 * 100
    assert await topology.unregister("actor", 7)
    assert (await topology.register(node(None, 9000))).rank == 7  # an unregistered hole first
    r.delete(keys.heartbeat("actor", 42))  # 42 died: its heartbeat key expired and its last beat is old
    r.zadd(keys.node_beats(), {"actor:42": time.time() - 120})
    # the role's own last-beat index (where dead ranks are looked for) missing, as records written before it
    # existed leave it, or corrupt (another type): beats still succeed, and the next rank-less registration
    # rebuilds it from node_beats
    r.delete(keys.role_stale("actor"))
    r.set(keys.role_beats("actor"), "corrupt")
    assert await topology.heartbeat("actor", 0) is not None
    assert (await topology.heartbeat_many([("actor", 1, "")]))[1] == [1]
    assert (await topology.register(node(None, 9001))).rank == 42  # a dead node's rank next
    assert (await topology.register(node(None, 9002))).rank == 400
    r.delete(keys.role_nodes("actor"))  # records gone behind the scripts' back: the search starts over
    assert (await topology.register(node(None, 9003))).rank == 0
    await client.aclose()
    r.close()


async def test_identity_index_follows_takeovers_unregister_sweep_and_old_records(dcs_config: DCSConfig) -> None:
    client = make_redis(dcs_config)
    keys = Keys(dcs_config.redis.namespace)
    topology = TopologyManager(client, keys, TopologyConfig(), 0.2)
    r = raw_redis(dcs_config)
    await topology.register(node(None, 9000))  # rank 0
    await topology.register(node(0, 9001))  # explicit rank 0 replaces 9000
    assert r.hget(keys.role_identities("actor"), "10.0.0.1:9000") is None
    assert (await topology.register(node(None, 9000))).rank == 1  # not rank 0: that is 9001's now
    assert await topology.unregister("actor", 1)
    assert r.hget(keys.role_identities("actor"), "10.0.0.1:9000") is None
    await topology.register(node(3, 9003))
    beats = [keys.heartbeat("actor", rank) for rank in (0, 3)]
    await eventually(lambda: r.exists(*beats) == 0, 15, "everyone's heartbeat TTL (0.2 s) to run out")
    await topology.sweep_dead_nodes(0.0)
    assert r.hlen(keys.role_identities("actor")) == 0 and r.hlen(keys.role_owners("actor")) == 0
    # records written before the identity index existed: the owners hash is scanned, the rank kept
    await topology.register(node(4, 9004))
    await topology.register(node(None, 9005))
    r.delete(keys.role_identities("actor"))
    assert (await topology.register(node(None, 9004))).rank == 4
    await client.aclose()
    r.close()


async def test_fleet_loop_reregisters_unknown_nodes_and_drops_fenced_ones(
    coord: InProcessCoordinator, dcs_config: DCSConfig
) -> None:
    api = coord.api
    infos = [node(i, 7300 + i) for i in range(3)]
    await api.register_many(infos)
    loop = FleetHeartbeatLoop(api, infos, interval=0.05)
    await loop.beat_once()
    assert loop.beats == 3 and loop.lost == []
    fenced = {"X-DCS-Node": "10.0.0.1:7301"}  # an operator forgot it (naming the node, as fencing requires):
    gone = await coord.authed.delete("/unregister", params={"role": "actor", "rank": 1}, headers=fenced)
    assert gone.status_code == 200  # the node (whose client still holds its identity) re-registers with its rank
    with raw_redis(dcs_config) as r:  # rank 2's node presumed dead (its TTL ran out): another node takes the rank
        r.delete(Keys(dcs_config.redis.namespace).heartbeat("actor", 2))
    taken = await coord.http.post("/register", json=node(2, 7999).model_dump())
    assert taken.status_code == 200
    loop.start()
    deadline = time.monotonic() + 10
    while not (loop.lost and loop.beats >= 8) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await loop.stop()
    assert loop.lost == ["actor_2"] and set(loop.nodes) == {("actor", 0), ("actor", 1)}
    held = (await api.topology("actor")).nodes["actor"]
    assert held[1].port == 7301 and held[2].port == 7999


@pytest.mark.parametrize("path", ["/heartbeats", "/heartbeat"])
async def test_a_node_beating_at_its_interval_is_swept_once_it_dies(dcs_config: DCSConfig, path: str) -> None:
    """A node beating at its interval for longer than the TTL plus the dead-node retention keeps its last-beat
    records under half the TTL old; once it stops beating it is listed dead (kept for the dead-node retention,
    not the never-beaten one) and then swept. Before, a batched beat rewrote the records only when the previous
    beat was older than half the TTL less 1.5 intervals, never at the interval: the node stayed marked never
    beaten, or, once one beat came late (here its first), the sweep dropped it from node_beats while it lived
    and after its death it stayed in /debug/topology and its role's records for good."""
    interval, ttl, retention = 0.3, 2.0, 1.5
    config = dcs_config.model_copy(
        update={
            "heartbeat_interval_seconds": interval,
            "heartbeat_timeout_seconds": ttl,
            "dead_node_retention_seconds": retention,
            "unbeaten_node_retention_seconds": 0.2,
        }
    )
    keys, r = Keys(config.redis.namespace), raw_redis(config)
    infos = [node(rank, 7400 + rank, role="fleet") for rank in range(4)]
    members = [f"fleet:{info.rank}" for info in infos]
    async with in_process_coordinator(config) as coord:
        api = coord.api
        loops: list[FleetHeartbeatLoop | HeartbeatLoop]
        if path == "/heartbeats":
            await api.register_many(infos)
            loops = [FleetHeartbeatLoop(api, infos, interval)]
        else:
            for info in infos:
                await api.register(info)
            loops = [HeartbeatLoop(api, info, interval) for info in infos]
        await asyncio.sleep(ttl / 2 - 1.5 * interval + 0.15)  # the first beat comes late (as after an agent restart)
        for loop in loops:
            await loop.beat_once()
            loop.start()
        ages: dict[str, float] = {}  # the oldest each record was seen while the node beat on time
        end = time.monotonic() + ttl + retention + 1.0  # beating past the TTL plus the retention, and more
        tick = calm_since = time.monotonic()
        samples = 0
        while time.monotonic() < end:
            now, last, tick = time.time(), tick, time.monotonic()
            if tick - last > 0.3:  # this process was starved (a loaded machine): the beats stalled with it
                calm_since = tick
            if tick - calm_since < 2 * interval:  # records are judged once the beats have caught up again
                await asyncio.sleep(0.05)
                continue
            samples += 1
            for member, info in zip(members, infos, strict=True):
                for name, key, field in (
                    (member, keys.node_beats(), member),
                    (f"role_beats {info.rank}", keys.role_beats("fleet"), str(info.rank)),
                ):
                    score = r.zscore(key, field)
                    ages[name] = max(ages.get(name, 0.0), float("inf") if score is None else now - score)
            await asyncio.sleep(0.05)
        for loop in loops:
            await loop.stop()
        assert all(loop.failures == 0 for loop in loops)
        assert samples >= 20, f"only {samples} samples while the beats were on time"
        alive = (await api.debug_topology()).nodes["fleet"]
        assert sorted(alive) == [0, 1, 2, 3] and all(v.alive for v in alive.values())
        # the role's record (scored half the TTL after the beat, rewritten every TTL less 1.5 intervals) never aged
        # past rank assignment's cutoff, half the TTL; node_beats, rewritten every beat here (its period, a tenth
        # of the retention, is under the interval), lagged less still
        assert max(ages.values()) < ttl / 2, ages
        assert r.zcard(keys.node_unbeaten()) == 0  # they beat: swept after the dead-node retention

        async def listed_dead() -> bool:
            fleet = (await api.debug_topology()).nodes.get("fleet", {})
            return sorted(fleet) == [0, 1, 2, 3] and not any(v.alive for v in fleet.values())

        async def swept() -> bool:
            return "fleet" not in (await api.debug_topology()).nodes

        await eventually(listed_dead, ttl + 10, "the fleet nodes to be listed dead")
        # removed after the retention more (sweeps every 0.2 s here); the bound is generous for a loaded machine
        await eventually(swept, retention + 10, "the dead fleet nodes to leave /debug/topology")
        assert not any(r.zscore(keys.node_beats(), m) for m in members) and r.hlen(keys.role_nodes("fleet")) == 0
    r.close()


async def test_batched_beats_rewrite_each_record_once_per_period_spread_over_the_fleet(dcs_config: DCSConfig) -> None:
    """HEARTBEAT_MANY on a clock the test sets, with the periods TopologyManager passes for interval 5 s, TTL 60 s
    and a dead-node retention of 600 s: a node's first beat after its registration writes both last-beat records
    at once (and ends its never-beaten mark); then, beating every interval or 0.5 to 1.5 intervals apart,
    node_beats lags the last beat by under its period (a tenth of the retention), the role's record never ages
    past rank assignment's cutoff (half the TTL) while the node beats nor claims it alive past its key's end, each
    record is written about once per its period (the point of the rule: not a write per beat), and the writes of
    a fleet beating in step spread over the period instead of all following its start. Every beat sets each node's
    heartbeat key to its time and refreshes the key's TTL."""
    interval, ttl, retention = 5.0, 60.0, 600.0
    role_period, node_period = ttl - 1.5 * interval, retention / 10  # what TopologyManager passes for these settings
    client = make_redis(dcs_config)
    keys, r = Keys(dcs_config.redis.namespace), raw_redis(dcs_config)
    topology = TopologyManager(client, keys, TopologyConfig(), ttl)
    count = 400
    await topology.register_many([node(rank, 7000 + rank, role="sim") for rank in range(count)])
    ranks = [str(rank) for rank in range(count)]
    members = [f"sim:{rank}" for rank in ranks]
    beat_keys = [keys.heartbeat("sim", rank) for rank in range(count)]
    packed = "\n".join(f"sim\n{rank}\n10.0.0.1:{7000 + rank}" for rank in range(count))
    head = [keys.node_beats(), keys.node_unbeaten()]
    prefixes = [keys.role_nodes_prefix(), keys.role_owners_prefix(), keys.heartbeat_prefix(), repr(role_period)]
    tail = [keys.role_beats_prefix(), keys.role_stale_prefix(), repr(node_period)]

    def records() -> tuple[list[float], list[float]]:
        """node_beats' and role_beats' scores of every node (-inf: none)."""
        nodes, roles = r.zmscore(keys.node_beats(), members), r.zmscore(keys.role_beats("sim"), ranks)
        return [float("-inf") if x is None else x for x in nodes], [float("-inf") if x is None else x for x in roles]

    clock = time.time()
    node_before, role_before = records()
    node_writes: list[int] = []
    role_writes: list[int] = []
    gaps = [interval] * 60 + [interval * (0.5 + (k * 0.618) % 1.0) for k in range(60)]  # in step, then uneven
    for gap in gaps:
        clock += gap
        # just before the beat (the longest since the last write): no role record aged past the cutoff
        assert min(role_before) > clock - ttl / 2 - 1e-3
        argv = [str(int(ttl * 1000)), repr(clock), *prefixes, packed, *tail]
        assert await scripts.HEARTBEAT_MANY.run_async(client, head, argv) == "1" * count
        node_after, role_after = records()
        node_writes.append(sum(a != b for a, b in zip(node_after, node_before, strict=True)))
        role_writes.append(sum(a != b for a, b in zip(role_after, role_before, strict=True)))
        if len(node_writes) == 1:  # the first beat after the registration (its mark in the heartbeat key)
            assert node_writes[0] == role_writes[0] == count and r.zcard(keys.node_unbeaten()) == 0
        assert max(clock - x for x in node_after) < node_period
        assert max(role_after) <= clock + ttl / 2  # half the TTL before the key this beat set runs out, no later
        # every node's heartbeat key holds this beat's time (what the sweep scores a live node with), TTL refreshed
        assert {float(v) for v in r.mget(beat_keys)} == {clock}
        assert min(r.pttl(key) for key in beat_keys[:: count // 8]) > ttl * 1000 - 5000
        node_before, role_before = node_after, role_after
    in_step = sum(gaps[1:60])  # after the first beat
    for writes, period in ((node_writes, node_period), (role_writes, role_period)):
        # each node once per period it crossed
        assert count * (in_step / period - 1) <= sum(writes[1:60]) <= count * (in_step / period + 1), writes
        assert sum(writes[1:]) < 0.15 * count * (len(gaps) - 1), writes  # about interval / period (under 0.1), not all
        # in step, a beat crosses the period boundaries of about interval / period of the nodes, not all of them
        assert max(writes[1:60]) < 0.2 * count, writes
    assert r.zcard(keys.node_unbeaten()) == 0
    await client.aclose()
    r.close()


async def test_the_sweep_keeps_a_live_node_in_node_beats_and_removes_it_once_dead(dcs_config: DCSConfig) -> None:
    """A batched beat rewrites node_beats once per refresh period, which may be longer than what the sweep leaves
    a record (here its period is never over and the retention is 1 s): the sweep puts a live node whose record it
    finds too old back into node_beats, scored with the heartbeat key's value (its last beat that wrote a record,
    here every beat: the role record's period is 0; the sweep's time for one that never beat), and removes it
    once it is dead. A node still marked never beaten whose key holds a beat after its registration (beaten by a
    coordinator whose beat left the mark) loses the mark; a live node that never beat keeps it. Before, the sweep
    dropped a live node from node_beats, where a batched beat did not put it back, so once dead it was never
    swept."""
    ttl, retention = 60.0, 1.0
    client = make_redis(dcs_config)
    keys, r = Keys(dcs_config.redis.namespace), raw_redis(dcs_config)
    topology = TopologyManager(client, keys, TopologyConfig(), ttl, unbeaten_retention_seconds=retention)
    await topology.register_many([node(rank, 7500 + rank, role="kept") for rank in range(4)])
    registered = time.time()
    members = [f"kept:{rank}" for rank in range(4)]
    prefixes = [keys.role_nodes_prefix(), keys.role_owners_prefix(), keys.heartbeat_prefix(), "0"]
    tail = [keys.role_beats_prefix(), keys.role_stale_prefix(), "1e9"]
    packed = "\n".join(f"kept\n{rank}\n10.0.0.1:{7500 + rank}" for rank in range(3))  # rank 3 never beats
    for at in (registered + 1, registered + 10, registered + 20):
        argv = [str(int(ttl * 1000)), repr(at), *prefixes, packed, *tail]
        assert await scripts.HEARTBEAT_MANY.run_async(client, [keys.node_beats(), keys.node_unbeaten()], argv) == "111"
    assert r.zmscore(keys.node_beats(), members[:3]) == [registered + 1] * 3  # the first beat's, never rewritten
    r.zadd(keys.node_unbeaten(), {members[2]: registered - 0.5})  # marked never beaten, as an older beat left it
    r.set(keys.heartbeat("kept", 1), "nan", keepttl=True)  # a hostile value: no time, the sweep goes on
    now = registered + 20 + ttl - 1  # the last beat's key still lives; every record is older than TTL + retention
    await topology.sweep_dead_nodes(retention, now=now)
    assert r.hlen(keys.role_nodes("kept")) == 4  # alive, all of them: kept
    # the last beat's time; the sweep's for the value that is no time and for the node that never beat
    assert r.zmscore(keys.node_beats(), members) == [registered + 20, now, registered + 20, now]
    assert r.zrange(keys.node_unbeaten(), 0, -1, withscores=True) == [(members[3], now)]  # looked at again later
    r.delete(*[keys.heartbeat("kept", rank) for rank in range(4)])  # they die
    await topology.sweep_dead_nodes(retention, now=now + ttl + retention + 1)
    assert r.hlen(keys.role_nodes("kept")) == 0 and r.zcard(keys.role_beats("kept")) == 0
    assert r.zmscore(keys.node_beats(), members) == [None] * 4 and r.zcard(keys.node_unbeaten()) == 0
    await client.aclose()
    r.close()


def read_response(sock: socket.socket) -> bytes:
    """One whole HTTP/1.1 answer (head and Content-Length body), or what came before the peer closed."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line[15:]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        chunk = sock.recv(4096)
        if not chunk:
            break
        body += chunk
    return data


def test_beats_at_the_heartbeat_interval_reuse_one_connection(dcs_config: DCSConfig, tmp_path: Path) -> None:
    """With the default settings the coordinator keeps an idle connection longer than the heartbeat interval
    (the client lets it go in between), so a node's beats do not reconnect every time (before: both were 5 s,
    the same as the interval, and every beat paid a new connection)."""
    defaults = DCSConfig()
    assert defaults.heartbeat.interval_seconds < KEEPALIVE_EXPIRY_S < defaults.coordinator.keep_alive_seconds
    config = dcs_config.model_copy(update={"coordinator_keep_alive_seconds": defaults.coordinator.keep_alive_seconds})
    coordinator = CoordinatorProcess(config, tmp_path / "coordinator.log").start()
    try:
        with socket.create_connection(("127.0.0.1", coordinator.port), timeout=10) as sock:
            request = b"GET /healthz HTTP/1.1\r\nHost: c\r\n\r\n"
            sock.sendall(request)
            assert read_response(sock).startswith(b"HTTP/1.1 200")
            time.sleep(defaults.heartbeat.interval_seconds + 0.5)  # idle for one heartbeat interval, and more
            sock.sendall(request)  # the next beat: on the same connection
            assert read_response(sock).startswith(b"HTTP/1.1 200"), "the connection was closed"
    finally:
        coordinator.stop()


async def test_a_batch_beat_replaces_a_heartbeat_key_of_the_wrong_type(
    coord: InProcessCoordinator, dcs_config: DCSConfig
) -> None:
    api, keys, r = coord.api, Keys(dcs_config.redis.namespace), raw_redis(dcs_config)
    await api.register_many([node(0, 7000), node(1, 7001)])
    r.delete(keys.heartbeat("actor", 0))
    r.hset(keys.heartbeat("actor", 0), "planted", "by someone with Redis access")
    assert await api.heartbeat_many([("actor", 0), ("actor", 1)]) == [BeatOutcome.OK, BeatOutcome.OK]
    assert r.type(keys.heartbeat("actor", 0)) == "string" and r.pttl(keys.heartbeat("actor", 0)) > 0
    # a value that is no time (a batched beat keeps the value while it writes no record) is replaced by the beat's
    # time and the records written, where a non-finite one would have stopped them for good
    for planted in ("nan", "inf", "garbage"):
        r.set(keys.heartbeat("actor", 1), planted, keepttl=True)
        before = r.zscore(keys.node_beats(), "actor:1")
        assert await api.heartbeat_many([("actor", 1)]) == [BeatOutcome.OK]
        assert float(r.get(keys.heartbeat("actor", 1)) or "nan") == r.zscore(keys.node_beats(), "actor:1") != before
    r.close()


async def test_batch_beats_outside_the_plain_path_are_normalised_or_refused_by_name(
    coord: InProcessCoordinator,
) -> None:
    """A body the fast path does not take (an identity to normalise, an unknown field) gets the full validation:
    the same outcomes, or a 422 naming the field."""
    await coord.api.register_many([node(0, 7000), node(1, 7001)])
    plain = {"beats": [{"role": "actor", "rank": 0, "identity": "10.0.0.1:7000"}]}
    padded = {"beats": [{"role": "actor", "rank": 1, "identity": "10.0.0.1:07001", "note": "ignored"}]}
    for body in (plain, padded):
        answer = await coord.authed.post("/heartbeats", json=body)
        assert answer.status_code == 200 and answer.json()["results"] == ["ok"], answer.text
    for bad, field in (({"role": "actor", "rank": -1, "identity": "10.0.0.1:7000"}, "beats.0.rank"),
                       ({"role": "actor", "rank": 0, "identity": "10.0.0.1:0"}, "beats.0.identity"),
                       ({"role": "act or", "rank": 0, "identity": "10.0.0.1:7000"}, "beats.0.role")):  # fmt: skip
        answer = await coord.authed.post("/heartbeats", json={"beats": [bad]})
        assert answer.status_code == 422 and field in answer.json()["detail"], answer.text
