"""Actor -> 2 real `dcs receiver` servers through the real coordinator, worker and gloo: bit-exact, versioned."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import redis
import torch

from dcs_tasks.client.engine import CheckpointEngineClient
from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import PortAllocationError
from dcs_tasks.keys import Keys
from dcs_tasks.metrics import get_metrics
from dcs_tasks.sync.group_bootstrap import port_binds, release_port, reserve_port
from dcs_tasks.sync.quantize import to_wire
from dcs_tasks.sync.receiving import tensor_sha256
from dcs_tasks.sync.wire import QuantizationConfig
from tests.distributed.sync_stack import SyncStack, actor_client, alive_ranks, sync_stack
from tests.helpers.redis_server import RedisDB, RedisServer
from tests.helpers.testconfig import short_config

pytestmark = [pytest.mark.integration, pytest.mark.distributed, pytest.mark.slow]


class Tiny(torch.nn.Module):
    """Mixed dtypes, many small tensors, several 4 KiB buckets, and one 9 MiB tensor sent zero-copy."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(6))
        self.head = torch.nn.Linear(8, 64)
        self.emb = torch.nn.Parameter(torch.randn(32, 16).to(torch.bfloat16))
        self.register_buffer("steps", torch.tensor([0], dtype=torch.int64))
        self.register_buffer("table", torch.randn(9 * 2**18 + 3))  # > 8 MiB: sent alone from its own memory


def sync_config(dcs_config: DCSConfig) -> DCSConfig:
    return dcs_config.model_copy(
        update={
            "bucket_size_bytes": 4096,
            "comm_timeout_seconds": 20.0,
            "group_init_timeout_seconds": 20.0,
            "max_retries": 1,
            "retry_delay_seconds": 0.2,
        }
    )


@pytest.fixture(scope="module")
def served(
    shared_redis: tuple[RedisServer, Iterator[int]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SyncStack]:
    """The module's coordinator and worker (`sync_stack` without receivers) on a config as `dcs_config` makes a
    test's (a database of its own on the shared redis-server, short heartbeats) with `sync_config`'s settings.
    None of these tests looks at the coordinator or the worker: each starts receivers and a trainer of its own
    (`module_stack`), and the trainers' groups get epochs of their own from the shared database."""
    server, indexes = shared_redis
    database = RedisDB(server, next(indexes))
    tmp = tmp_path_factory.mktemp("weight-sync")
    base = short_config(database.url, tmp)
    try:
        with sync_stack(sync_config(base), tmp) as stack:
            yield stack
    finally:
        database.flush()


def live_engines(stack: SyncStack) -> dict[str, set[int]]:
    """The ranks of every engine role with a live node."""
    roles = ("rollout", "rollout_b")
    return {role: ranks for role in roles if (ranks := alive_ranks(stack.url, role, stack.config.token()))}


@contextmanager
def module_stack(served: SyncStack, tmp_path: Path, receivers: int = 0) -> Iterator[SyncStack]:
    """The module's coordinator and worker with `receivers` new `dcs receiver`s (ranks 0..), stopped at the end;
    no engine of an earlier test is alive before, none of this one after. (A stopped trainer's actor rank stays
    held until its heartbeat timeout: the next test's trainer registers once it is free, as a restarted one does.)"""
    stack = SyncStack(served.config, served.coordinator, served.worker, tmp_path)
    assert live_engines(stack) == {}
    try:
        for rank in range(receivers):
            stack.add_receiver(rank)
        yield stack
    finally:
        for receiver in stack.receivers:
            receiver.stop()
        deadline = time.monotonic() + 30  # a receiver killed without unregistering leaves after its heartbeat timeout
        while live := live_engines(stack):
            assert time.monotonic() < deadline, f"still alive after the test: {live}"
            time.sleep(0.1)


def expected_digest(model: torch.nn.Module) -> dict[str, str]:
    return {name: tensor_sha256(t) for name, t in model.state_dict().items()}


def train_step(model: Tiny) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
        model.steps += 1


async def test_actor_pushes_bit_exact_weights_to_two_receivers(served: SyncStack, tmp_path: Path) -> None:
    with module_stack(served, tmp_path, receivers=2) as stack:
        model = Tiny()
        client = CheckpointEngineClient(
            coordinator_url=stack.url, role="actor", rank=0, model=model, model_name="tiny", config=stack.config
        )
        await client.start()
        sent_before, sent = counter(get_metrics().export_prometheus(), "dcs_bytes_sent_total"), 0
        try:
            for update in range(1, 4):
                train_step(model)
                metrics = (await client.update_weights_for_rollout(rollout_only=True))["rollout"]
                sent += metrics["bytes"]
                assert metrics["weight_version"] == update
                assert metrics["group_rebuilt"] is (update == 1)
                assert metrics["buckets"] > 1 and metrics["engines"] == 2 and metrics["flattened"]
                for receiver in stack.receivers:
                    digest = receiver.digest()
                    assert digest.weight_version == update
                    assert digest.tensors == expected_digest(model)
                    read = httpx.post(f"{receiver.url}/get_weights_by_name", json={"name": "head.weight"}).json()
                    assert read == model.head.weight.tolist()[:100]  # SGLang's read-back route
            assert counter(get_metrics().export_prometheus(), "dcs_bytes_sent_total") - sent_before == sent
            for receiver in stack.receivers:
                assert counter(httpx.get(f"{receiver.url}/metrics").content, "dcs_bytes_received_total") == sent
        finally:
            await client.stop()


def counter(exposition: bytes | str, name: str) -> float:
    """The value of an unlabelled sample in Prometheus text exposition (as served, or as exported: a str)."""
    text = exposition.decode() if isinstance(exposition, bytes) else exposition
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


async def test_late_receiver_gets_the_full_current_weights_at_the_next_update(
    served: SyncStack, tmp_path: Path
) -> None:
    with module_stack(served, tmp_path, receivers=1) as stack:
        model = Tiny()
        client = CheckpointEngineClient(
            coordinator_url=stack.url, role="actor", rank=0, model=model, model_name="tiny", config=stack.config
        )
        await client.start()
        try:
            for _ in range(2):
                train_step(model)
                await client.update_weights_for_rollout(rollout_only=True)
            late = stack.add_receiver(1)
            assert late.digest().weight_version == 0 and late.digest().tensors == {}
            train_step(model)
            metrics = (await client.update_weights_for_rollout(rollout_only=True))["rollout"]
            assert metrics["group_rebuilt"] and metrics["engines"] == 2
            for receiver in stack.receivers:
                digest = receiver.digest()
                assert digest.weight_version == 3 and digest.tensors == expected_digest(model)
        finally:
            await client.stop()


async def test_two_groups_on_one_host_at_once_get_distinct_ports(served: SyncStack, tmp_path: Path) -> None:
    config = served.config
    with module_stack(served, tmp_path) as stack:
        stack.add_receiver(0, role="rollout")
        stack.add_receiver(0, role="rollout_b")
        models = [Tiny(), Tiny()]
        clients = [
            CheckpointEngineClient(
                coordinator_url=stack.url,
                role="actor",
                rank=rank,
                model=models[rank],
                model_name="tiny",
                config=stack.config,
                rollout_role=peer,
            )
            for rank, peer in enumerate(("rollout", "rollout_b"))
        ]
        for client in clients:
            await client.start()
        try:
            results = await asyncio.gather(*(c.update_weights_for_rollout(rollout_only=True) for c in clients))
            ports = {stack_port(stack, r["rollout"]["group_name"]) for r in results}
            assert len(ports) == 2 and all(config.sync.comm_base_port <= p <= config.sync.comm_max_port for p in ports)
            for receiver, model in zip(stack.receivers, models, strict=True):
                assert receiver.digest().tensors == expected_digest(model)
            assert expected_digest(models[0]) != expected_digest(models[1])
        finally:
            for client in clients:
                await client.stop()
        released = redis.Redis.from_url(config.redis.url)
        keys = Keys(config.redis.namespace)
        deadline = time.monotonic() + 20
        while any(released.exists(keys.port_reservation(config.host_name, p)) for p in ports):
            assert time.monotonic() < deadline, "destroy did not release the master ports"
            time.sleep(0.1)


def stack_port(stack: SyncStack, group_name: str) -> int:
    record = redis.Redis.from_url(stack.config.redis.url, decode_responses=True).hgetall(
        Keys(stack.config.redis.namespace).group(group_name)
    )
    return int(record["master_port"])


def test_port_reservation_skips_reserved_and_bound_ports_then_fails_named(dcs_config: DCSConfig) -> None:
    client = redis.Redis.from_url(dcs_config.redis.url, decode_responses=True)
    keys = Keys(dcs_config.redis.namespace)
    base = free_port_block(3)
    config = dcs_config.model_copy(update={"comm_base_port": base, "comm_max_port": base + 2})
    client.set(keys.port_reservation(config.host_name, base), "someone-else")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", base + 1))
        busy.listen()
        assert reserve_port(client, keys, config, "127.0.0.1", "g1") == base + 2
        assert client.get(keys.port_reservation(config.host_name, base + 1)) is None
        with pytest.raises(PortAllocationError):
            reserve_port(client, keys, config, "127.0.0.1", "g2")
    assert not release_port(client, keys, config.host_name, base + 2, "g2")  # only the owner releases
    assert release_port(client, keys, config.host_name, base + 2, "g1")


def free_port_block(n: int) -> int:
    for start in range(40000, 60000, n):
        if all(port_binds("127.0.0.1", p) for p in range(start, start + n)):
            return start
    raise RuntimeError("no free block of ports")


async def test_quantized_update_sends_bf16_of_fp32_masters(served: SyncStack, tmp_path: Path) -> None:
    with module_stack(served, tmp_path, receivers=1) as stack:
        model = Tiny()
        client = CheckpointEngineClient(
            coordinator_url=stack.url, role="actor", rank=0, model=model, model_name="tiny", config=stack.config
        )
        await client.start()
        try:
            quant = QuantizationConfig(dtype="bfloat16")
            metrics = (await client.update_weights_for_rollout(rollout_only=True, quantization=quant))["rollout"]
            state = model.state_dict()
            wire_bytes = sum(to_wire(t, quant).numel() * to_wire(t, quant).element_size() for t in state.values())
            full_bytes = sum(t.numel() * t.element_size() for t in state.values())
            assert metrics["bytes"] == wire_bytes < full_bytes  # fp32 went as bf16
            expected = {n: tensor_sha256(to_wire(t, quant)) for n, t in state.items()}
            digest = stack.receivers[0].digest()
            assert digest.weight_version == 1 and digest.tensors == expected
            assert expected["steps"] == tensor_sha256(state["steps"])  # ints untouched
        finally:
            await client.stop()


async def test_dcs_receiver_answers_like_sglang_0_5_23_on_the_wire(served: SyncStack, tmp_path: Path) -> None:
    """Same routes, bodies, status codes and messages as SGLang 0.5.23 (sglang/srt/entrypoints/http_server.py and
    its scheduler's weight updater), and nothing DCS-private: no /get_weight_version, no store keys."""
    with module_stack(served, tmp_path, receivers=1) as stack, httpx.Client(base_url=stack.receivers[0].url) as http:
        info = http.get("/server_info").json()
        assert (info["version"], info["tp_size"], info["dp_size"], info["pp_size"]) == ("0.5.23", 1, 1, 1)
        assert http.get("/get_server_info").json()["version"] == "0.5.23"
        assert http.get("/model_info").json()["weight_version"] == "default"
        assert http.get("/get_weight_version").status_code == 404
        health = http.get("/health")
        assert health.status_code == 200 and health.content == b""
        bucket = {"names": ["w"], "dtypes": ["float32"], "shapes": [[2]], "group_name": "g"}
        outside = http.post("/update_weights_from_distributed", json=bucket)
        assert outside.status_code == 400 and outside.json() == {
            "success": False,
            "message": "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()",
        }
        assert http.post("/end_weight_update", json={}).json() == {
            "success": False,
            "message": "no weight-update session is open; call begin_weight_update() first",
        }
        assert http.post("/begin_weight_update", json={}).json() == {"success": True, "message": "Success"}
        again = http.post("/begin_weight_update", json={})
        assert again.status_code == 400 and "already open" in again.json()["message"]
        assert http.post("/end_weight_update", json={}).status_code == 200
        paused = http.post("/pause_generation", json={"mode": "retract"})
        assert paused.json() == {"message": "Generation paused successfully.", "status": "ok"}
        assert http.post("/continue_generation", json={}).json()["status"] == "ok"
        unknown = http.post("/get_weights_by_name", json={"name": "nope"})
        assert unknown.status_code == 400 and unknown.json() == {"error": {"message": "Get parameter by name failed"}}
        gone = http.post("/destroy_weights_update_group", json={"group_name": "nope"})
        assert gone.status_code == 400 and gone.json()["message"] == "The group to be destroyed does not exist."
        invalid = http.post("/init_weights_update_group", json={"master_address": "127.0.0.1"})
        assert invalid.status_code == 400  # SGLang overrides FastAPI's 422
        answer = invalid.json()
        assert (answer["object"], answer["type"], answer["param"], answer["code"]) == (
            "error",
            "Bad Request",
            None,
            400,
        )
        assert "master_port" in answer["message"] and "Field required" in answer["message"]


async def test_a_restarted_trainer_keeps_weight_versions_rising(served: SyncStack, tmp_path: Path) -> None:
    with module_stack(served, tmp_path, receivers=1) as stack:
        model = Tiny()
        for expected in (2, 3):  # the second client is the trainer after a restart
            client = CheckpointEngineClient(
                coordinator_url=stack.url, role="actor", rank=0, model=model, model_name="tiny", config=stack.config
            )
            await client.start()
            try:
                if expected == 2:
                    await client.update_weights_for_rollout(rollout_only=True)
                train_step(model)
                metrics = (await client.update_weights_for_rollout(rollout_only=True))["rollout"]
                assert metrics["weight_version"] == expected
                digest = stack.receivers[0].digest()
                assert digest.weight_version == expected and digest.tensors == expected_digest(model)
            finally:
                await client.stop()


async def test_an_engine_restarted_at_its_address_gets_a_new_group_before_any_bucket(
    served: SyncStack, tmp_path: Path
) -> None:
    """An engine restarted at the same rank, ip and port between two updates is a new process outside the
    formed group. Its new registration's `instance` token tells the trainer so: the next update rebuilds the
    group and lands whole on both engines, instead of failing (and leaving the other engine paused)."""
    model = Tiny()
    with module_stack(served, tmp_path, receivers=2) as stack:
        async with actor_client(stack, model, "tiny") as client:
            await client.update_weights_for_rollout(rollout_only=True)
            restarted = stack.receivers[1]
            port = restarted.port
            restarted.stop()
            restarted.start()  # same rank, same port: a new process
            assert restarted.port == port
            train_step(model)
            metrics = (await client.update_weights_for_rollout(rollout_only=True))["rollout"]
            assert metrics["group_rebuilt"] and metrics["engines"] == 2 and metrics["weight_version"] == 2
            for receiver in stack.receivers:
                digest = receiver.digest()
                assert digest.weight_version == 2 and digest.tensors == expected_digest(model)


async def test_a_replaced_engine_is_noticed_before_any_bucket_and_the_sessions_opened_meanwhile_are_closed(
    served: SyncStack, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With a group to reuse, the trainer pauses and opens sessions on the group's engines while it reads the
    topology; when the topology shows an engine replaced, it must close those sessions (no bucket sent) and
    rebuild, so the rebuilt group's sessions open without finding one left open and the update lands whole."""
    with module_stack(served, tmp_path, receivers=2) as stack:
        model = Tiny()
        client = CheckpointEngineClient(
            coordinator_url=stack.url, role="actor", rank=0, model=model, model_name="tiny", config=stack.config
        )
        await client.start()
        try:
            await client.update_weights_for_rollout(rollout_only=True)
            old = stack.receivers.pop(1)
            assert old.proc is not None
            stopped = old.proc
            old.stop()
            assert stopped.returncode == 0, f"SIGTERM did not stop rollout_1 cleanly: {old.log_tail()}"
            stack.add_receiver(1)  # same rank, another port
            train_step(model)
            with caplog.at_level("WARNING", logger="dcs_tasks.sync.rollout"):
                try:
                    metrics = (await client.update_weights_for_rollout(rollout_only=True))["rollout"]
                finally:  # the pause/begin calls cancelled on rollout_0 once killed it by SIGPIPE, silently
                    survivor = stack.receivers[0]
                    assert survivor.proc is not None and survivor.proc.poll() is None, (
                        f"rollout_0 ended ({survivor.proc and survivor.proc.poll()}): {survivor.log_tail()}"
                    )
            assert metrics["group_rebuilt"] and metrics["engines"] == 2 and metrics["weight_version"] == 2
            assert "session open" not in caplog.text  # the speculative session on rollout_0 was ended
            for receiver in stack.receivers:
                digest = receiver.digest()
                assert digest.weight_version == 2 and digest.tensors == expected_digest(model)
            train_step(model)
            metrics = (await client.update_weights_for_rollout(rollout_only=True))["rollout"]
            assert not metrics["group_rebuilt"] and metrics["weight_version"] == 3
            assert all(r.digest().weight_version == 3 for r in stack.receivers)
        finally:
            await client.stop()
