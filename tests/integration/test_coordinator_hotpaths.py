"""The hot paths (coordinator.hotpaths: POST /heartbeats, GET /recv_weight_meta, POST /register served without
FastAPI's routing layer) answer as the routes do, behind the same checks, and a long-poll wakes only for what it
waits for (real redis-server, the app in-process)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import pytest
from pydantic import SecretStr

from dcs_tasks.config import DCSConfig, RoleInfo
from dcs_tasks.models import RegisterResponse, WeightMeta, WeightMetaBatch
from tests.integration.coordinator_support import InProcessCoordinator, in_process_coordinator

pytestmark = pytest.mark.integration

TOKEN = "hot-path-token"


@pytest.fixture
async def coord(dcs_config: DCSConfig) -> AsyncIterator[InProcessCoordinator]:
    config = dcs_config.model_copy(update={"auth_token": SecretStr(TOKEN)})
    async with in_process_coordinator(config) as c:
        yield c


def meta(name: str) -> WeightMeta:
    return WeightMeta(names=[name], dtypes=["bfloat16"], shapes=[[4, 4]], group_name="g")


def register_body(rank: int | None, port: int) -> dict[str, object]:
    return {"role_name": "actor", "rank": rank, "ip": "10.0.0.1", "port": port}


async def test_a_long_poll_sleeps_through_beats_and_registrations_and_wakes_at_an_append(
    coord: InProcessCoordinator,
) -> None:
    """What a poll waits for is the log: liveness beats, joins and leaves change nothing in it and do not answer
    it; an append answers it promptly with the entry."""
    end = (await coord.api.recv_weight_meta(0)).end_index
    poll = asyncio.create_task(coord.authed.get("/recv_weight_meta", params={"index": end, "wait_timeout_s": 10}))
    nodes = [RoleInfo(role_name="actor", rank=r, ip="10.0.0.1", port=2000 + r) for r in range(20)]
    await coord.api.register_many(nodes)
    beats = [{"role": "actor", "rank": r, "identity": f"10.0.0.1:{2000 + r}"} for r in range(20)]
    for _ in range(5):
        answer = await coord.authed.post("/heartbeats", json={"beats": beats})
        assert answer.status_code == 200 and answer.json()["results"] == ["ok"] * 20
        await coord.api.heartbeat("actor", 0, ip="10.0.0.1", port=2000)
        await asyncio.sleep(0.05)
    left = await coord.authed.delete("/unregister?role=actor&rank=19", headers={"X-DCS-Node": "10.0.0.1:2019"})
    assert left.status_code == 200
    await coord.api.register(RoleInfo(role_name="actor", rank=19, ip="10.0.0.1", port=2019))
    await asyncio.sleep(0.3)
    assert not poll.done()  # nothing it waits for changed
    appended = time.monotonic()
    await coord.api.send_weight_meta(meta("new"))
    answer = await asyncio.wait_for(poll, 5.0)
    assert time.monotonic() - appended < 2.0
    batch = WeightMetaBatch.model_validate_json(answer.content)
    assert batch.entries == [meta("new")] and batch.next_index == end + 1


async def test_a_long_poll_ends_empty_at_its_timeout(coord: InProcessCoordinator) -> None:
    start = time.monotonic()
    answer = await coord.authed.get("/recv_weight_meta", params={"index": 5, "wait_timeout_s": 0.3})
    assert answer.status_code == 200
    assert WeightMetaBatch.model_validate_json(answer.content).entries == []
    assert 0.25 < time.monotonic() - start < 5.0


async def test_hot_and_routed_answers_are_the_same(coord: InProcessCoordinator) -> None:
    """A plain request (the hot path) and one the hot path leaves to the route get the same answer."""
    for i in range(3):
        await coord.api.send_weight_meta(meta(f"m{i}"))
    hot = await coord.authed.get("/recv_weight_meta?index=1&limit=1")
    routed = await coord.authed.get("/recv_weight_meta?limit=1&index=1&unused=x")  # an unknown name: the route
    assert hot.status_code == routed.status_code == 200
    assert hot.content == routed.content
    assert hot.headers["content-type"] == routed.headers["content-type"] == "application/json"
    assert WeightMetaBatch.model_validate_json(hot.content).entries == [meta("m1")]

    hot = await coord.authed.post("/register", json=register_body(4, 1004))
    routed = await coord.authed.post(
        "/register",
        content=json.dumps(register_body(5, 1005)).encode(),
        headers={"content-type": "application/json; charset=utf-8"},  # another content type: the route
    )
    assert hot.status_code == routed.status_code == 200
    assert RegisterResponse.model_validate_json(hot.content) == RegisterResponse(
        rank=4, node_id="actor_4", message="registered with the requested rank", identity="10.0.0.1:1004"
    )
    assert json.loads(routed.content) == {**json.loads(hot.content), "rank": 5, "node_id": "actor_5"} | {
        "identity": "10.0.0.1:1005"
    }
    again = await coord.authed.post("/register", json=register_body(None, 1004))
    assert again.json()["rank"] == 4 and again.json()["message"] == "re-registered; rank kept"


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/recv_weight_meta?index=0", None),
        ("POST", "/register", register_body(0, 1000)),
        ("POST", "/heartbeats", {"beats": [{"role": "actor", "rank": 0, "identity": "10.0.0.1:1000"}]}),
    ],
)
async def test_hot_paths_need_the_token(
    coord: InProcessCoordinator, method: str, path: str, body: dict[str, object] | None
) -> None:
    answer = await coord.http.request(method, path, json=body)
    assert answer.status_code == 401 and "bearer token" in answer.json()["detail"]


async def test_hot_path_errors_are_the_routes_named_errors(coord: InProcessCoordinator) -> None:
    for query, named in [
        ("index=-1", "query.index"),
        ("index=0&wait_timeout_s=301", "query.wait_timeout_s"),
        ("index=0&limit=100001", "query.limit"),
        ("index=x", "query.index"),
    ]:
        answer = await coord.authed.get(f"/recv_weight_meta?{query}")
        assert answer.status_code == 422, query
        assert answer.json()["detail"].startswith("invalid request: ") and named in answer.json()["detail"], query
    bad_register = [
        (b"{", "body"),
        (json.dumps({**register_body(0, 1), "rank": -1}).encode(), "body.rank"),
        (json.dumps({**register_body(0, 1), "role_name": "a b"}).encode(), "body.role_name"),
        (json.dumps({**register_body(0, 1), "unknown": 1}).encode(), "body.unknown"),
    ]
    for raw, named in bad_register:
        answer = await coord.authed.post("/register", content=raw, headers={"content-type": "application/json"})
        assert answer.status_code == 422, raw
        assert named in answer.json()["detail"], (raw, answer.json())
    deep = {**register_body(0, 1), "metadata": {"a": {"b": {"c": {"d": {"e": {"f": {"g": {"h": {}}}}}}}}}}
    too_deep = {**register_body(0, 1), "metadata": json.loads("{" + '"a":{' * 200 + "}" * 200 + "}")}
    assert (await coord.authed.post("/register", json=deep)).status_code == 200
    answer = await coord.authed.post("/register", json=too_deep)
    assert answer.status_code == 422 and "metadata" in answer.json()["detail"]
    await coord.authed.post("/register", json=register_body(7, 1007))
    taken = await coord.authed.post("/register", json=register_body(7, 1099))  # a live rank of another identity
    assert taken.status_code == 409 and "actor_7" in taken.json()["detail"]


async def test_hot_paths_are_counted_under_their_route(coord: InProcessCoordinator) -> None:
    await coord.authed.get("/recv_weight_meta?index=0")
    await coord.authed.post("/register", json=register_body(0, 1000))
    beats = {"beats": [{"role": "actor", "rank": 0, "identity": "10.0.0.1:1000"}]}
    await coord.authed.post("/heartbeats", json=beats)
    text = (await coord.http.get("/metrics")).text
    for method, route in [("GET", "/recv_weight_meta"), ("POST", "/register"), ("POST", "/heartbeats")]:
        assert f'dcs_coordinator_requests_total{{method="{method}",route="{route}",status="200"}} 1.0' in text


async def test_a_redis_failure_on_a_hot_path_is_a_503(coord: InProcessCoordinator, dcs_config: DCSConfig) -> None:
    services = coord.app.state.services
    await services.redis.aclose()
    real = services.redis
    broken = real.__class__.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.5)
    services.redis = services.topology.redis = services.weight_meta.redis = broken
    try:
        answer = await coord.authed.post("/register", json=register_body(0, 1000))
        assert answer.status_code == 503 and "Redis" in answer.json()["detail"]
        assert answer.headers["retry-after"] == "1"
    finally:
        services.redis = services.topology.redis = services.weight_meta.redis = real
        await broken.aclose()
