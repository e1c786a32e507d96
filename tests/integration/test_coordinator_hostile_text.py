"""Hostile text and aborted bodies against a real `dcs coordinator` (uvicorn) and a real `dcs receiver`.

A string holding a lone surrogate (JSON `"\\ud800"`) is not Unicode text: every body carrying one is refused
with the validation error naming where it is, whichever path serves the request (the hot path for
`application/json`, the FastAPI route for any other JSON content type), nothing is stored and nothing is
logged as a crash. A /register body the client stops sending is the same 400 on both paths, never counted as
a 500 nor logged as an unhandled exception.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from pydantic import SecretStr

from dcs_tasks.config import DCSConfig
from tests.distributed.sync_stack import ReceiverProcess, auth_headers
from tests.helpers.procs import CoordinatorProcess

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TOKEN = "hostile-text-token-5e1a"
NODE = '"role_name":"actor","rank":0,"port":1000'


def _node(fields: str) -> str:
    return "{" + NODE + "," + fields + "}"


# (path, raw JSON body, where the 422 says the string is)
SURROGATES = [
    ("/register", _node('"ip":"10.0.0.1","metadata":{"k":"\\ud800"}'), "body.metadata.k"),
    ("/register", _node('"ip":"10.0.0.1","metadata":{"a":[1,{"\\udfff":2}]}'), "body.metadata.a.1"),
    ("/register", _node('"ip":"\\ud800"'), "body.ip"),
    ("/register", _node('"ip":"10.0.0.\\udc00x"'), "body.ip"),
    (
        "/register_batch",
        '{"nodes":[' + _node('"ip":"1.2.3.4","metadata":{"k":"\\ud800"}') + "]}",
        "body.nodes.0.metadata.k",
    ),
    (
        "/register_batch",
        '{"nodes":[' + _node('"ip":"1.2.3.4"') + "," + _node('"ip":"\\ud800"') + "]}",
        "body.nodes.1.ip",
    ),
    ("/send_weight_meta", '{"names":["\\ud800"],"dtypes":["f"],"shapes":[[1]],"group_name":"g"}', "body.names.0"),
    ("/send_weight_meta", '{"names":["a"],"dtypes":["\\ud800"],"shapes":[[1]],"group_name":"g"}', "body.dtypes.0"),
    ("/heartbeats", '{"beats":[{"role":"actor","rank":0,"identity":"\\ud800:1000"}]}', "body"),
]


@pytest.fixture
def coordinator(dcs_config: DCSConfig, tmp_path: Path) -> Iterator[CoordinatorProcess]:
    config = dcs_config.model_copy(update={"auth_token": SecretStr(TOKEN)})
    proc = CoordinatorProcess(config, tmp_path / "coordinator.log").start()
    yield proc
    proc.stop()


def _post(client: httpx.Client, path: str, raw: bytes, content_type: str) -> httpx.Response:
    return client.post(path, content=raw, headers={"content-type": content_type})


def test_a_lone_surrogate_in_any_body_is_422_on_both_paths_and_nothing_is_stored(
    coordinator: CoordinatorProcess,
) -> None:
    with httpx.Client(base_url=coordinator.url, headers=auth_headers(TOKEN), timeout=10) as client:
        for path, body, where in SURROGATES:
            hot = _post(client, path, body.encode(), "application/json")
            routed = _post(client, path, body.encode(), "application/json; charset=utf-8")
            assert hot.status_code == routed.status_code == 422, (path, body, hot.text, routed.text)
            assert hot.json() == routed.json(), (path, body)
            assert hot.json()["detail"].startswith(f"invalid request: {where}"), (path, body, hot.text)
        # the same surrogate as raw bytes (ED A0 80), which json.loads of bytes decodes with 'surrogatepass'
        raw = _node('"ip":"10.0.0.1","metadata":{"k":"').encode() + b'\xed\xa0\x80"}}'
        for content_type in ("application/json", "application/json; charset=utf-8"):
            answer = _post(client, "/register", raw, content_type)
            assert answer.status_code == 422 and "body.metadata.k" in answer.json()["detail"], answer.text
        # a surrogate pair is one character, taken as it is
        pair = _node('"ip":"10.0.0.1","metadata":{"k":"\\ud83d\\ude00"}')
        assert _post(client, "/register", pair.encode(), "application/json").status_code == 200
        topology = client.get("/topology").json()
        assert topology["nodes"]["actor"]["0"]["metadata"] == {"k": "\U0001f600"}
        assert client.get("/recv_weight_meta", params={"index": 0}).json()["entries"] == []
        metrics = client.get("/metrics").text
    assert 'status="500"' not in metrics
    log = coordinator.log_tail(200_000)
    assert "Traceback" not in log and "UnicodeEncodeError" not in log, log[-3000:]


def _send_part_of_a_body(port: int, path: str, content_type: str) -> None:
    """A POST declaring 400 body bytes, of which 20 are sent before the connection is closed."""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n"
        f"Content-Type: {content_type}\r\nContent-Length: 400\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(head.encode() + b'{"role_name":"actor",')
        time.sleep(0.3)  # the app is reading the body when the client goes


def _count(metrics: str, route: str, status: int) -> float:
    prefix = f'dcs_coordinator_requests_total{{method="POST",route="{route}",status="{status}"}} '
    return sum(float(line.removeprefix(prefix)) for line in metrics.splitlines() if line.startswith(prefix))


ABORTED = ("/register", "/heartbeats", "/register_batch", "/send_weight_meta")


def test_an_aborted_body_is_the_same_400_on_both_paths_and_never_a_500(coordinator: CoordinatorProcess) -> None:
    for path in ABORTED:
        for content_type in ("application/json", "application/json; charset=utf-8"):  # the hot path, the route
            _send_part_of_a_body(coordinator.port, path, content_type)
    with httpx.Client(base_url=coordinator.url, headers=auth_headers(TOKEN), timeout=10) as client:
        deadline = time.monotonic() + 10
        while True:
            metrics = client.get("/metrics").text
            counted = sum(_count(metrics, p, s) for p in ABORTED for s in (400, 500))
            if counted >= 2 * len(ABORTED) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert client.post("/register", json={"role_name": "actor", "ip": "10.0.0.1", "port": 1}).status_code == 200
    assert {p: _count(metrics, p, 500) for p in ABORTED} == dict.fromkeys(ABORTED, 0), metrics
    assert {p: _count(metrics, p, 400) for p in ABORTED} == dict.fromkeys(ABORTED, 2), metrics
    log = coordinator.log_tail(200_000)
    assert "ClientDisconnect" not in log and "Traceback" not in log, log[-3000:]


def test_the_receiver_refuses_a_lone_surrogate_as_an_invalid_body(
    coordinator: CoordinatorProcess, dcs_config: DCSConfig, tmp_path: Path
) -> None:
    """`dcs receiver` answers every body that does not validate with SGLang's 400: one holding a lone surrogate
    too, before the string reaches a group init, a log line or a weight look-up. A body it is not sent whole is
    FastAPI's 400, not a logged exception."""
    config = dcs_config.model_copy(update={"auth_token": SecretStr(TOKEN), "group_init_timeout_seconds": 1.0})
    receiver = ReceiverProcess(config, coordinator.url, 0, tmp_path / "receiver.log").start()
    init = '{"master_address":"%s","master_port":1234,"rank_offset":1,"world_size":2,"group_name":"%s"}'
    cases = [
        ("/init_weights_update_group", init % ("\\ud800", "g"), "master_address"),
        ("/init_weights_update_group", init % ("127.0.0.1", "\\ud800"), "group_name"),
        ("/destroy_weights_update_group", '{"group_name":"\\ud800"}', "group_name"),
        ("/get_weights_by_name", '{"name":"\\ud800"}', "name"),
        (
            "/update_weights_from_distributed",
            '{"names":["a"],"dtypes":["float32"],"shapes":[[1]],"weight_version":"\\ud800"}',
            "weight_version",
        ),
    ]
    try:
        with httpx.Client(base_url=receiver.url, headers=auth_headers(TOKEN), timeout=10) as client:
            assert client.post("/begin_weight_update").status_code == 200
            for path, body, field in cases:
                answer = _post(client, path, body.encode(), "application/json")
                assert answer.status_code == 400, (path, answer.text)
                assert answer.json()["object"] == "error" and "lone surrogate" in answer.json()["message"], answer.text
                assert f"'body', '{field}'" in answer.json()["message"], answer.text
            assert client.get("/weights_digest").json() == {"weight_version": 0, "tensors": {}}
            _send_part_of_a_body(receiver.port, "/update_weights_from_distributed", "application/json")
            assert client.get("/weights_digest").status_code == 200
        log = receiver.log_tail(200_000)
        assert "Traceback" not in log and "Failed to initialize" not in log, log[-3000:]
        assert "ClientDisconnect" not in log, log[-3000:]
    finally:
        receiver.stop()
