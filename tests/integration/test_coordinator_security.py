"""Hostile and broken input, auth, and Redis outages: the coordinator answers with the right status."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest
import redis
from pydantic import SecretStr

from dcs_tasks.config import DCSConfig, RoleInfo
from dcs_tasks.errors import AuthError, CoordinatorUnavailable
from dcs_tasks.keys import Keys
from tests.helpers.redis_server import RedisServer
from tests.helpers.waiting import eventually
from tests.integration.coordinator_support import InProcessCoordinator, in_process_coordinator

pytestmark = pytest.mark.integration

TOKEN = "s3cret-token"


@pytest.fixture
async def coord(dcs_config: DCSConfig) -> AsyncIterator[InProcessCoordinator]:
    config = dcs_config.model_copy(update={"max_body_bytes": 4096})
    async with in_process_coordinator(config) as c:
        yield c


@pytest.fixture
async def secured(dcs_config: DCSConfig) -> AsyncIterator[InProcessCoordinator]:
    async with in_process_coordinator(dcs_config.model_copy(update={"auth_token": SecretStr(TOKEN)})) as c:
        yield c


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"role_name": "actor", "rank": -1}, "rank"),
        ({"role_name": "actor", "world_size": -3}, "world_size"),
        ({"role_name": "actor", "rank": "zero"}, "rank"),
        ({"rank": 0}, "role_name: Field required"),
        ({"role_name": "bad role!"}, "role_name"),
        ({"role_name": "actor", "port": 70000}, "port"),
        ({"role_name": "actor", "rank": 2**53 + 1}, "rank"),  # Lua would round it and store another rank
        ({"role_name": "actor", "world_size": 10**20}, "world_size"),
    ],
)
async def test_bad_register_bodies_are_422_with_a_readable_message(
    coord: InProcessCoordinator, body: dict[str, object], expected: str
) -> None:
    response = await coord.http.post("/register", json=body)
    assert response.status_code == 422
    assert expected in response.json()["detail"]


async def test_malformed_json_and_bad_queries_are_422(coord: InProcessCoordinator) -> None:
    response = await coord.http.post("/register", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 422
    assert (await coord.http.get("/heartbeat", params={"role": "actor", "rank": -1})).status_code == 422
    assert (await coord.http.get("/heartbeat", params={"role": "actor"})).status_code == 422
    assert (await coord.http.get("/recv_weight_meta", params={"index": -1})).status_code == 422
    mismatched = {"names": ["a", "b"], "dtypes": ["f32"], "shapes": [[1]], "group_name": "g"}
    response = await coord.http.post("/send_weight_meta", json=mismatched)
    assert response.status_code == 422 and "equal lengths" in response.json()["detail"]


async def test_oversized_body_is_413_by_header_and_by_stream(coord: InProcessCoordinator) -> None:
    big = {"role_name": "actor", "metadata": {"blob": "x" * 10_000}}
    response = await coord.http.post("/register", json=big)
    assert response.status_code == 413 and "4096" in response.json()["detail"]

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: the size is counted while streaming
        yield b'{"role_name": "actor", "metadata": {"blob": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}}'

    response = await coord.http.post("/register", content=chunks(), headers={"content-type": "application/json"})
    assert response.status_code == 413 and "DCS_MAX_BODY_BYTES" in response.json()["detail"]
    assert (await coord.api.topology()).world_size == 0


async def test_token_required_except_healthz_and_metrics(secured: InProcessCoordinator) -> None:
    http = secured.http
    assert (await http.get("/topology")).status_code == 401
    wrong = await http.get("/topology", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and "bearer token" in wrong.json()["detail"]
    assert (await http.post("/register", json={"role_name": "a"})).status_code == 401
    assert (await http.get("/healthz")).status_code == 200
    assert (await http.get("/metrics")).status_code == 200
    registered = await secured.api.register(RoleInfo(role_name="actor"))  # the typed client sends the token
    assert registered.rank == 0
    assert (await http.get("/topology", headers={"Authorization": f"Bearer {TOKEN}"})).status_code == 200


async def test_wrong_token_in_client_raises_auth_error(secured: InProcessCoordinator) -> None:
    from dcs_tasks.coordinator_api import CoordinatorAPI

    transport = httpx.ASGITransport(app=secured.app)
    async with CoordinatorAPI("http://coordinator", "wrong", transport=transport) as api:
        with pytest.raises(AuthError):
            await api.topology()


@pytest.mark.own_redis
async def test_redis_down_is_503_then_recovers(coord: InProcessCoordinator, redis_server: RedisServer) -> None:
    await coord.api.register(RoleInfo(role_name="actor", rank=0))
    redis_server.stop()
    response = await coord.http.get("/topology")
    assert response.status_code == 503
    assert f"127.0.0.1:{redis_server.port}" in response.json()["detail"]
    coord.api.retry_for_s = 0  # the 503 itself, not the client's retries (test_coordinator_retries.py)
    with pytest.raises(CoordinatorUnavailable):
        await coord.api.heartbeat("actor", 0)
    assert (await coord.http.get("/healthz")).status_code == 200
    redis_server.start()
    await coord.api.heartbeat("actor", 0)  # the Lua script is reloaded into the new server (NOSCRIPT)
    assert (await coord.api.topology()).nodes["actor"][0].rank == 0


@pytest.mark.own_redis
async def test_long_poll_survives_a_redis_restart(
    coord: InProcessCoordinator, redis_server: RedisServer, dcs_config: DCSConfig
) -> None:
    redis_server.restart()
    client = redis_server.client()
    channel = Keys(dcs_config.redis.namespace).weight_meta_channel()
    await eventually(lambda: dict(client.pubsub_numsub(channel)).get(channel, 0) >= 1, 15, "the resubscription")
    waiter = asyncio.create_task(coord.api.recv_weight_meta(0, wait_timeout_s=10))
    await eventually(lambda: _script_calls(client) >= 1, 15, "the long-poll's first (empty) read")  # now waiting
    from dcs_tasks.models import WeightMeta

    await coord.api.send_weight_meta(WeightMeta.end())
    assert (await asyncio.wait_for(waiter, 5)).entries == [WeightMeta.end()]
    client.close()


def _script_calls(client: redis.Redis) -> int:
    """EVALSHA calls the server counted (the weight-meta reads are one script each)."""
    return int(client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


async def test_coordinator_unreachable_is_coordinator_unavailable() -> None:
    from dcs_tasks.coordinator_api import CoordinatorAPI
    from tests.helpers.ports import free_port

    async with CoordinatorAPI(f"http://127.0.0.1:{free_port()}", timeout=2) as api:
        with pytest.raises(CoordinatorUnavailable, match="unreachable"):
            await api.health()


@pytest.mark.parametrize("value", ["nonsense", "10.0.0.1:", "10.0.0.1:99999", ":80"])
async def test_malformed_node_header_on_heartbeat_is_422(coord: InProcessCoordinator, value: str) -> None:
    await coord.api.register(RoleInfo(role_name="actor", rank=0, port=80))
    response = await coord.http.get("/heartbeat", params={"role": "actor", "rank": 0}, headers={"X-DCS-Node": value})
    assert response.status_code == 422 and "X-DCS-Node" in response.json()["detail"]


ENDPOINTS = {
    "/register", "/unregister", "/heartbeat", "/topology", "/peer", "/node", "/global_rank",
    "/get_model_update_group_ranks", "/send_weight_meta", "/recv_weight_meta", "/clear_weight_meta",
    "/health", "/debug/topology", "/healthz", "/metrics",
}  # fmt: skip


async def test_openapi_schema_and_docs_render(coord: InProcessCoordinator) -> None:
    schema = (await coord.http.get("/openapi.json")).json()
    assert ENDPOINTS <= set(schema["paths"])
    beat_params = {p["name"] for p in schema["paths"]["/heartbeat"]["get"]["parameters"]}
    assert {"role", "rank", "X-DCS-Node"} <= beat_params
    docs = await coord.http.get("/docs")
    assert docs.status_code == 200 and "swagger" in docs.text.lower()


async def test_with_a_token_the_docs_need_it_too(secured: InProcessCoordinator) -> None:
    for path in ("/docs", "/openapi.json"):
        assert (await secured.http.get(path)).status_code == 401
        answer = await secured.http.get(path, headers={"Authorization": f"Bearer {TOKEN}"})
        assert answer.status_code == 200
    assert "/heartbeat" in answer.json()["paths"]


async def test_a_command_redis_refuses_is_503_naming_the_reason(
    coord: InProcessCoordinator, redis_server: RedisServer, dcs_config: DCSConfig
) -> None:
    from dcs_tasks.keys import Keys

    # (a wrong-typed topology record is skipped instead: see test_coordinator_hostile.py)
    redis_server.client().set(Keys(dcs_config.redis.namespace).weight_meta(), "not a list")
    response = await coord.http.get("/recv_weight_meta")
    assert response.status_code == 503
    detail = response.json()["detail"]
    assert "WRONGTYPE" in detail and "refused the command" in detail and "unreachable" not in detail


async def test_arbitrary_methods_do_not_grow_the_metric_labels(coord: InProcessCoordinator) -> None:
    for i in range(20):
        assert (await coord.http.request(f"X{i}", "/healthz")).status_code == 405
    text = (await coord.http.get("/metrics")).text
    assert 'method="OTHER",route="/healthz",status="405"} 20.0' in text and 'method="X1"' not in text


async def test_huge_rank_in_a_query_is_422(coord: InProcessCoordinator) -> None:
    response = await coord.http.get("/heartbeat", params={"role": "actor", "rank": 2**60})
    assert response.status_code == 422 and "rank" in response.json()["detail"]


async def test_a_server_that_is_not_a_coordinator_gives_a_typed_error() -> None:
    from fastapi import FastAPI

    from dcs_tasks.coordinator_api import CoordinatorAPI
    from dcs_tasks.errors import CoordinatorError

    other = FastAPI()

    @other.get("/health")
    async def health() -> dict[str, str]:
        return {"hello": "world"}

    async with CoordinatorAPI("http://other", transport=httpx.ASGITransport(app=other)) as api:
        with pytest.raises(CoordinatorError, match="not a HealthResponse") as info:
            await api.health()
        assert info.value.status_code == 200
