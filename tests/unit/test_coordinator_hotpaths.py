"""coordinator.hotpaths: which queries and bodies the hot paths take themselves; whatever they take, FastAPI's
route would read the same way (everything else goes on to the route, which judges it)."""

from __future__ import annotations

import json
from typing import Annotated

import pytest
from fastapi import FastAPI, Query
from fastapi.testclient import TestClient

from coordinator.hotpaths import plain_poll_query, plain_register_body
from coordinator.routes.weight_meta import MAX_LIMIT, MAX_WAIT_S
from dcs_tasks.models import MAX_INDEX

TAKEN = [
    b"",
    b"index=0",
    b"index=7&wait_timeout_s=20.0",
    b"wait_timeout_s=0.5&index=12",
    b"index=3&limit=0",
    b"index=0&limit=100000",
    b"index=0007&wait_timeout_s=300",
    f"index={MAX_INDEX}".encode(),
]
LEFT_TO_THE_ROUTE = [
    b"index=-1",  # 422 from the route
    b"index=%31",  # percent-encoded
    b"index=1&index=2",  # repeated: the route takes the last
    b"index=1&other=2",  # an unknown name: the route ignores it
    b"index=1e3",
    b"index= 1",
    b"index",
    b"index=",
    b"wait_timeout_s=.5",
    b"wait_timeout_s=5.",
    b"wait_timeout_s=1.2.3",
    b"wait_timeout_s=300.5",
    b"wait_timeout_s=nan",
    b"wait_timeout_s=inf",
    b"limit=100001",
    f"index={MAX_INDEX + 1}".encode(),
    b"index=" + b"9" * 17,
    b"&index=1",
]


def route_reading() -> TestClient:
    """A FastAPI route with /recv_weight_meta's query parameters, answering what it read."""
    app = FastAPI()

    @app.get("/q")
    def q(
        index: Annotated[int, Query(ge=0, le=MAX_INDEX)] = 0,
        wait_timeout_s: Annotated[float, Query(ge=0, le=MAX_WAIT_S)] = 0.0,
        limit: Annotated[int | None, Query(ge=0, le=MAX_LIMIT)] = None,
    ) -> list[object]:
        return [index, wait_timeout_s, limit]

    return TestClient(app)


@pytest.mark.parametrize("query", TAKEN)
def test_a_plain_poll_query_reads_as_the_route_reads_it(query: bytes) -> None:
    taken = plain_poll_query(query)
    assert taken is not None
    answer = route_reading().get("/q?" + query.decode())
    assert answer.status_code == 200
    assert answer.json() == list(taken)


@pytest.mark.parametrize("query", LEFT_TO_THE_ROUTE)
def test_any_other_poll_query_is_left_to_the_route(query: bytes) -> None:
    assert plain_poll_query(query) is None


def test_a_register_body_is_taken_only_when_json_and_valid() -> None:
    body = {"role_name": "actor", "rank": 3, "ip": "10.0.0.1", "port": 1024, "metadata": {"a": [1]}}
    raw = json.dumps(body).encode()
    taken = plain_register_body(raw, b"application/json")
    assert taken is not None and taken.rank == 3 and taken.metadata == {"a": [1]}
    assert plain_register_body(json.dumps({**body, "ip": None}).encode(), b"application/json") is not None
    for content_type in (None, b"text/plain", b"application/json; charset=utf-8"):
        assert plain_register_body(raw, content_type) is None  # the route reads other content types its way
    for bad in (b"", b"{", b"[]", b'{"role_name": "a b"}', json.dumps({**body, "extra": 1}).encode()):
        assert plain_register_body(bad, b"application/json") is None
    assert plain_register_body(b"[" * 100_000 + b"]" * 100_000, b"application/json") is None  # RecursionError
