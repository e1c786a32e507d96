"""A real `dcs receiver` (DCS_AUTH_TOKEN set) facing hostile callers: unauthenticated calls, inits to dead
addresses, impossible shapes, slow clients. The test process plays the trainer: it is rank 0 of a real gloo
group with the receiver and broadcasts real updates (SGLang's per-tensor wire format)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from pydantic import SecretStr

from dcs_tasks.backends.base import GroupSpec
from dcs_tasks.backends.device_direct import DeviceDirectBackend
from dcs_tasks.client.engine import CheckpointEngineClient
from dcs_tasks.config import DCSConfig
from dcs_tasks.sync.receiver.cli import INIT_WAIT_SECONDS
from dcs_tasks.sync.receiving import tensor_sha256
from tests.distributed.sync_stack import ReceiverProcess, alive_ranks, auth_headers, sync_stack, wait_registered
from tests.helpers.ports import free_port
from tests.helpers.preloaded import run_module
from tests.helpers.procs import REPO, CoordinatorProcess, child_env
from tests.helpers.redis_server import RedisDB, RedisServer
from tests.helpers.testconfig import short_config

pytestmark = [pytest.mark.integration, pytest.mark.distributed]

TOKEN = "receiver-test-token-7f3a"
INIT_TIMEOUT = 2.0  # the receiver's group_init_timeout_seconds in these tests
AUTH = auth_headers(TOKEN)


@dataclass
class Trainer:
    """Rank 0 of update groups with one receiver, driving it over HTTP like DCS's trainer does."""

    receiver: ReceiverProcess
    backend: DeviceDirectBackend
    pool: ThreadPoolExecutor

    def post(self, route: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> httpx.Response:
        return httpx.post(
            f"{self.receiver.url}/{route}", json=body, headers=AUTH if headers is None else headers, timeout=60
        )

    def get(self, route: str, headers: dict[str, str] | None = None) -> httpx.Response:
        return httpx.get(f"{self.receiver.url}/{route}", headers=AUTH if headers is None else headers, timeout=60)

    def join(self, group: str) -> None:
        port = free_port()
        formed = self.pool.submit(self.backend.create_group, GroupSpec(group, "127.0.0.1", port, 2, 0))
        answer = self.post("init_weights_update_group", init_body(group, "127.0.0.1", port))
        assert answer.status_code == 200 and answer.json()["success"], answer.text
        formed.result(timeout=30)

    def session(self, begin: bool) -> None:
        """SGLang's weight-update session: updates are accepted between begin and end only."""
        answer = self.post("begin_weight_update" if begin else "end_weight_update", {})
        assert answer.status_code == 200, answer.text

    def send(self, group: str, tensors: dict[str, torch.Tensor], **fields: Any) -> httpx.Response:
        """One update request, its tensors broadcast one by one (SGLang's default wire format)."""
        body = {
            "names": list(tensors),
            "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors.values()],
            "shapes": [list(t.shape) for t in tensors.values()],
            "group_name": group,
        }
        answer = self.pool.submit(self.post, "update_weights_from_distributed", body | fields)
        handles = [self.backend.broadcast_async(t, 0, group) for t in tensors.values()]
        response = answer.result(timeout=30)
        assert response.status_code == 200, response.text  # else the broadcasts have no receiver
        for handle in handles:
            handle.wait()
        return response

    def push(self, group: str, version: int, tensors: dict[str, torch.Tensor]) -> httpx.Response:
        """One whole update in one request, committed at its end."""
        self.session(begin=True)
        response = self.send(group, tensors, weight_version=str(version), flush_cache=True)
        self.session(begin=False)
        return response

    def digest(self) -> tuple[int, dict[str, str]]:
        answer = self.receiver.digest()
        return answer.weight_version, answer.tensors


def init_body(group: str, address: str, port: int) -> dict[str, Any]:
    return {
        "master_address": address,
        "master_port": port,
        "rank_offset": 1,
        "world_size": 2,
        "group_name": group,
        "backend": "gloo",
    }


def digest_of(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {name: tensor_sha256(t) for name, t in tensors.items()}


@dataclass(frozen=True)
class Served:
    """The module's coordinator (requiring TOKEN) and the config it was started from."""

    config: DCSConfig
    coordinator: CoordinatorProcess


@pytest.fixture(scope="module")
def served(
    shared_redis: tuple[RedisServer, Iterator[int]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    """One `dcs coordinator` for the receiver_stack tests, on a config as `dcs_config` makes a test's (a database
    of its own on the shared redis-server, short heartbeats) requiring TOKEN. The receivers' settings under test
    are theirs, not the coordinator's: each test starts a receiver of its own (`receiver_stack`)."""
    server, indexes = shared_redis
    database = RedisDB(server, next(indexes))
    tmp = tmp_path_factory.mktemp("receiver-security")
    config = short_config(database.url, tmp, auth_token=SecretStr(TOKEN))
    coordinator = CoordinatorProcess(config, tmp / "coordinator.log").start()
    try:
        yield Served(config, coordinator)
    finally:
        coordinator.stop()
        database.flush()


@contextmanager
def receiver_stack(served: Served, tmp_path: Path, **settings: Any) -> Iterator[Trainer]:
    """The module's coordinator and a new `dcs receiver`, both requiring TOKEN, and a trainer backend in this
    process; the receiver is rank 0 of rollout, which no live node holds before or after."""
    coordinator = served.coordinator
    update = {"group_init_timeout_seconds": INIT_TIMEOUT, "comm_timeout_seconds": 20.0}
    config = served.config.model_copy(update=update | settings | {"coordinator_url": coordinator.url})
    assert alive_ranks(coordinator.url, "rollout", TOKEN) == set()
    receiver = ReceiverProcess(config, coordinator.url, 0, tmp_path / "receiver.log")
    backend = DeviceDirectBackend(timeout_seconds=20, group_init_timeout_seconds=20)
    try:
        receiver.start()
        with ThreadPoolExecutor(16) as pool:
            yield Trainer(receiver, backend, pool)
    finally:
        backend.close()
        receiver.stop()
        # gone at once when it unregistered; a receiver killed instead leaves after its heartbeat timeout
        wait_registered(coordinator.url, "rollout", 0, 30, alive=False, token=TOKEN)


def dead_address() -> tuple[str, int]:
    """A local port nothing listens on: a rendezvous there can only time out."""
    return "127.0.0.1", free_port()


def test_unauthenticated_calls_are_refused_and_change_nothing(served: Served, tmp_path: Path) -> None:
    with receiver_stack(served, tmp_path) as trainer:
        trainer.join("g1")
        v1 = {"w": torch.randn(4, 3), "b": torch.arange(5)}
        assert trainer.push("g1", 1, v1).status_code == 200
        assert trainer.digest() == (1, digest_of(v1))

        hostile = {"w": torch.zeros(4, 3), "b": torch.zeros(5, dtype=torch.int64)}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}, {"X-Api-Key": TOKEN}):
            refused = trainer.post("init_weights_update_group", init_body("evil", *dead_address()), headers)
            assert refused.status_code == 401 and refused.json() == {"error": "Unauthorized"}
            body = {"names": ["w"], "dtypes": ["float32"], "shapes": [[4, 3]], "group_name": "g1"}
            update = trainer.post("update_weights_from_distributed", body | {"weight_version": "99"}, headers)
            assert update.status_code == 401
            destroy = trainer.post("destroy_weights_update_group", {"group_name": "g1"}, headers)
            assert destroy.status_code == 401
            for route in ("weights_digest", "model_info", "server_info", "openapi.json"):
                assert trainer.get(route, headers).status_code == 401
            begin = trainer.post("begin_weight_update", {}, headers)
            assert begin.status_code == 401
        for public in ("health", "metrics"):
            assert trainer.get(public, {}).status_code == 200
        assert trainer.get("model_info").json()["weight_version"] == "1"

        # still in g1, weights and version untouched: the next real update over g1 lands
        assert trainer.digest() == (1, digest_of(v1))
        assert trainer.push("g1", 2, hostile).status_code == 200
        assert trainer.digest() == (2, digest_of(hostile))


def test_failed_init_keeps_the_current_group(served: Served, tmp_path: Path) -> None:
    with receiver_stack(served, tmp_path) as trainer:
        trainer.join("g1")
        v1 = {"w": torch.randn(8)}
        assert trainer.push("g1", 1, v1).status_code == 200

        started = time.monotonic()
        failed = trainer.post("init_weights_update_group", init_body("g2", *dead_address()))
        took = time.monotonic() - started
        assert failed.status_code == 400 and failed.json()["success"] is False
        assert "g2" in failed.json()["message"]
        assert took < INIT_TIMEOUT + 3, f"a dead init took {took:.1f}s"

        same = trainer.post("init_weights_update_group", init_body("g1", *dead_address()))
        assert same.status_code == 400 and "already a member of group 'g1'" in same.json()["message"]

        v2 = {"w": torch.randn(8)}
        assert trainer.push("g1", 2, v2).status_code == 200, "the receiver left its group"
        assert trainer.digest() == (2, digest_of(v2))


def test_parallel_dead_inits_neither_stall_reads_nor_each_other(served: Served, tmp_path: Path) -> None:
    with receiver_stack(served, tmp_path) as trainer:
        trainer.join("g1")
        v1 = {"w": torch.randn(16)}
        assert trainer.push("g1", 1, v1).status_code == 200

        def dead_init(i: int) -> tuple[httpx.Response, float]:
            started = time.monotonic()
            answer = trainer.post("init_weights_update_group", init_body(f"dead{i}", *dead_address()))
            return answer, time.monotonic() - started

        inits = [trainer.pool.submit(dead_init, i) for i in range(8)]
        time.sleep(0.3)
        slowest = 0.0
        while not all(f.done() for f in inits):
            for route in ("weights_digest", "model_info", "health"):
                started = time.monotonic()
                assert trainer.get(route).status_code == 200
                slowest = max(slowest, time.monotonic() - started)
            time.sleep(0.1)
        assert slowest < 1.0, f"a read waited {slowest:.2f}s behind pending inits"
        for future in inits:
            answer, took = future.result()
            assert answer.status_code == 400 and answer.json()["success"] is False
            assert took < INIT_WAIT_SECONDS + INIT_TIMEOUT + 5, f"an init was answered after {took:.1f}s"
        busy = [f.result()[0].json()["message"] for f in inits if "in flight" in f.result()[0].json()["message"]]
        assert busy, "concurrent inits were not bounded"

        assert trainer.digest() == (1, digest_of(v1))
        v2 = {"w": torch.randn(16)}
        assert trainer.push("g1", 2, v2).status_code == 200
        assert trainer.digest() == (2, digest_of(v2))


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_impossible_updates_are_refused_before_allocating(served: Served, tmp_path: Path) -> None:
    with receiver_stack(served, tmp_path, receiver_max_update_bytes=1024 * 1024) as trainer:
        trainer.join("g1")
        assert trainer.receiver.proc is not None
        rss_before = rss_bytes(trainer.receiver.proc.pid)
        trainer.session(begin=True)

        def refused(names: list[str], dtypes: list[str], shapes: list[list[int]], group: str = "g1") -> str:
            body = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group, "weight_version": "1"}
            answer = trainer.post("update_weights_from_distributed", body)
            assert answer.status_code == 400, answer.text
            assert answer.headers["content-type"] == "application/json" and answer.json()["success"] is False
            return str(answer.json()["message"])

        assert "receiver_max_update_bytes" in refused(["huge"], ["float32"], [[2**40]])  # 4 TiB
        assert "receiver_max_update_bytes" in refused(["a", "b"], ["uint8", "uint8"], [[2**19], [2**19 + 1]])
        assert "negative" in refused(["w"], ["float32"], [[4, -1]])
        assert "unsupported dtype" in refused(["w"], ["float128"], [[4]])
        assert "dimensions" in refused(["w"], ["float32"], [[1] * 17])
        assert "repeat" in refused(["w", "w"], ["float32", "float32"], [[1], [1]])
        assert "1..1024 characters" in refused(["x" * 1025], ["float32"], [[1]])
        assert "not a member of group 'other'" in refused(["w"], ["float32"], [[1]], group="other")
        assert rss_bytes(trainer.receiver.proc.pid) < rss_before + 64 * 1024 * 1024

        # the per-update bound spans requests: 600 KiB staged, then 600 KiB more is refused
        first = {"a": torch.zeros(600 * 1024, dtype=torch.uint8)}
        trainer.send("g1", first, flush_cache=False)
        assert "receiver_max_update_bytes" in refused(["b"], ["uint8"], [[600 * 1024]])

        v1 = {"w": torch.randn(3, 3)}  # the refused request left the staged update intact: v1 holds both
        trainer.send("g1", v1, weight_version="1", flush_cache=True)
        trainer.session(begin=False)
        assert trainer.digest() == (1, digest_of(first | v1))


def closed_within(sock: socket.socket, seconds: float, trickle: bytes | None) -> bool:
    """Whether the server closes `sock` within `seconds`, while we send `trickle` every 0.2 s (None: silence)."""
    deadline = time.monotonic() + seconds
    sock.settimeout(0.2)
    while time.monotonic() < deadline:
        try:
            if trickle is not None:
                sock.sendall(trickle)
            if sock.recv(4096) == b"":
                return True
        except TimeoutError:
            continue
        except (ConnectionResetError, BrokenPipeError):
            return True
    return False


def test_slow_and_silent_clients_are_disconnected(served: Served, tmp_path: Path) -> None:
    with receiver_stack(served, tmp_path, receiver_request_read_timeout_seconds=1.0) as trainer:
        address = ("127.0.0.1", trainer.receiver.port)
        with socket.create_connection(address) as slow:
            slow.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            started = time.monotonic()
            assert closed_within(slow, 5.0, trickle=b"X-Slow: 1\r\n"), "a header trickle held the connection"
            assert time.monotonic() - started < 3.0
        with socket.create_connection(address) as silent:
            assert closed_within(silent, 5.0, trickle=None), "a silent connection was held open"
        with socket.create_connection(address) as body:
            body.sendall(b"POST /init_weights_update_group HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
            assert closed_within(body, 5.0, trickle=b" "), "a body trickle held the connection"
        assert trainer.get("health").status_code == 200  # prompt clients are served as before


async def test_trainer_pushes_through_the_whole_stack_with_a_token(dcs_config: DCSConfig, tmp_path: Path) -> None:
    """Coordinator, worker and two receivers all require DCS_AUTH_TOKEN; the trainer's client, the worker's
    join task and the engine calls carry it, so updates land bit-exact, and a caller without it is refused."""
    update = {"auth_token": SecretStr(TOKEN), "bucket_size_bytes": 4096, "group_init_timeout_seconds": 20.0}
    config = dcs_config.model_copy(update=update | {"comm_timeout_seconds": 20.0, "max_retries": 1})
    with sync_stack(config, tmp_path, receivers=2) as stack:
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
        client = CheckpointEngineClient(
            coordinator_url=stack.url, role="actor", rank=0, model=model, model_name="tiny", config=stack.config
        )
        await client.start()
        try:
            for version in (1, 2):
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(torch.randn_like(p))
                metrics = (await client.update_weights_for_rollout(rollout_only=True))["rollout"]
                assert metrics["weight_version"] == version and metrics["engines"] == 2
                for receiver in stack.receivers:
                    assert receiver.digest().model_dump() == {
                        "weight_version": version,
                        "tensors": digest_of(model.state_dict()),
                    }
        finally:
            await client.stop()
        for receiver in stack.receivers:
            assert httpx.get(f"{receiver.url}/weights_digest", timeout=10).status_code == 401


def test_a_wildcard_bind_needs_an_advertised_address(dcs_config: DCSConfig, tmp_path: Path) -> None:
    args = ("--coordinator-url", "http://127.0.0.1:9", "--rank", "0", "--host", "0.0.0.0")
    # `dcs receiver` forked from the preloaded forkserver: no interpreter start and torch import of its own
    done = run_module(
        "dcs_tasks.cli.main", "receiver", *args, workdir=tmp_path, env=child_env(dcs_config), cwd=REPO, timeout=60
    )
    assert done.returncode == 2 and "--advertise-host" in done.stderr


def test_oversized_bodies_are_refused_unread(served: Served, tmp_path: Path) -> None:
    with receiver_stack(served, tmp_path, receiver_max_body_bytes=64 * 1024) as trainer:
        names = [f"layer.{i}.weight" for i in range(8000)]  # ~150 KiB of JSON
        body = {"names": names, "dtypes": ["float32"] * 8000, "shapes": [[1]] * 8000, "group_name": "g1"}
        refused = trainer.post("update_weights_from_distributed", body)
        assert refused.status_code == 413 and "65536 bytes" in refused.json()["detail"]

        def chunks() -> Iterator[bytes]:
            for _ in range(100):
                yield b" " * 1024

        streamed = httpx.post(
            f"{trainer.receiver.url}/init_weights_update_group", content=chunks(), headers=AUTH, timeout=30
        )
        assert streamed.status_code == 413 and "65536 bytes" in streamed.json()["detail"]
        unauthenticated = trainer.post("update_weights_from_distributed", body, headers={})
        assert unauthenticated.status_code == 401
        assert trainer.get("health").status_code == 200
