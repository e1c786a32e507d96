"""A trainer pushes weights into engines running SGLang's own code (tests/sglang_engine: SGLang's HTTP app,
API-key middleware, tokenizer manager, ZMQ, TP scheduler processes and weight-update stack; only the GPU
model and batcher are replaced), registered through `dcs engine attach`, with the README's API only.

Versions: 0.5.20 (no begin/end session API) and 0.5.23 (sessions), installed by `make sglang-engines`.
Weights are read back through SGLang's own `/get_weights_by_name` (`SGLangEngine.weights`, in the stored
dtype) and compared bit for bit.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest
import torch
from pydantic import SecretStr

from dcs_tasks.client.engine import CheckpointEngineClient
from dcs_tasks.errors import EngineAuthRefused, EngineIncompatible, WeightSyncError
from tests.distributed.sync_stack import SyncStack, sync_stack
from tests.helpers.redis_server import RedisDB, RedisServer
from tests.helpers.testconfig import short_config
from tests.integration.engine_attach_support import AttachProcess, rollout_nodes, wait_for
from tests.sglang_engine.harness import SGLangEngine, installed, warm
from tests.sglang_engine.tiny_model import HIDDEN, INTERMEDIATE, SHAPES, VOCAB

pytestmark = [pytest.mark.integration, pytest.mark.distributed, pytest.mark.slow]
TOKEN = "sglang-engines-token-7d2e"
VERSIONS = ("0.5.20", "0.5.23")

missing = [v for v in VERSIONS if not installed(v)]
if missing:
    pytestmark.append(pytest.mark.skip(reason=f"SGLang {', '.join(missing)} not installed (make sglang-engines)"))


def bits(tensor: torch.Tensor) -> bytes:
    return tensor.detach().contiguous().view(torch.uint8).numpy().tobytes()


class TinyLlama(torch.nn.Module):
    """The trainer's model: the engine model's parameter names, shapes and dtypes, plus `extra` tensors the
    engine does not have (SGLang's `load_weights` skips unknown names), to make an update long."""

    def __init__(self, extra: int = 0) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(VOCAB, HIDDEN)
        layer = torch.nn.Module()
        layer.mlp = torch.nn.Module()
        layer.mlp.up_proj = torch.nn.Linear(HIDDEN, INTERMEDIATE, bias=False)
        self.model.layers = torch.nn.ModuleList([layer])
        self.model.norm = torch.nn.Module()
        self.model.norm.weight = torch.nn.Parameter(torch.randn(HIDDEN).to(torch.bfloat16))
        self.lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False).to(torch.float16)
        self.extra = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(16384)) for _ in range(extra))

    def served(self) -> dict[str, bytes]:
        """The raw bytes each engine parameter must hold after an update."""
        return {n: bits(t) for n, t in self.state_dict().items() if n in SHAPES}

    def step(self) -> None:
        with torch.no_grad():
            for p in self.parameters():
                p.add_(torch.randn_like(p.float()).to(p.dtype))


@pytest.fixture(scope="module")
def module_stack(
    shared_redis: tuple[RedisServer, Iterator[int]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SyncStack]:
    """One coordinator and worker for the module's tests (none of them looks at those processes), on a config
    as `dcs_config` makes a test's (a database of its own on the shared redis-server, short heartbeats)."""
    warm(*VERSIONS)  # both SGLang versions' imports run while the stack starts (tests/sglang_engine/zygote.py)
    server, indexes = shared_redis
    database = RedisDB(server, next(indexes))
    tmp = tmp_path_factory.mktemp("sglang-engines")
    config = short_config(database.url, tmp).model_copy(
        update={
            "auth_token": SecretStr(TOKEN),
            "comm_timeout_seconds": 30.0,
            "group_init_timeout_seconds": 60.0,
            "max_retries": 1,
            "retry_delay_seconds": 0.2,
        }
    )
    with sync_stack(config, tmp) as stack:
        yield stack
    database.flush()


def live_nodes(stack: SyncStack) -> dict[str, dict[str, object]]:
    """Every live node `/topology` reports, by role."""
    answer = httpx.get(f"{stack.url}/topology", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    answer.raise_for_status()
    return {role: nodes for role, nodes in answer.json()["nodes"].items() if nodes}


@pytest.fixture
def stack(module_stack: SyncStack) -> Iterator[SyncStack]:
    """The module's stack, its processes alive and no live node when the test starts and none after it (every
    test stops what it attached; a node registered by hand leaves when its heartbeat timeout runs out)."""
    for proc in (module_stack.coordinator, module_stack.worker):
        assert proc.proc is not None and proc.proc.poll() is None, proc.log_tail()
    assert live_nodes(module_stack) == {}
    yield module_stack
    wait_for("no live node left", lambda: live_nodes(module_stack) == {}, timeout=30)


def engine_bits(engine: SGLangEngine) -> dict[str, bytes]:
    return {name: bits(engine.weights(name)) for name in SHAPES}


def weight_version(engine: SGLangEngine) -> str:
    return str(engine.get("/model_info").json()["weight_version"])


@contextmanager
def attached(
    stack: SyncStack, tmp: Path, specs: list[dict[str, object]], env: dict[str, str] | None = None
) -> Iterator[list[SGLangEngine]]:
    """Start one engine per spec (SGLangEngine keyword arguments plus "version"), concurrently, and attach each
    with `dcs engine attach` at its list index as its rollout rank."""
    engines = []
    for i, spec in enumerate(dict(s) for s in specs):
        (tmp / f"engine{i}").mkdir()  # its own work dir (the served model's config)
        version = str(spec.pop("version"))
        engines.append(SGLangEngine(version, tmp / f"engine{i}" / "engine.log", **spec))  # type: ignore[arg-type]
    with ExitStack() as cleanup:
        for engine in engines:
            cleanup.callback(engine.stop)
        with ThreadPoolExecutor(len(engines)) as pool:
            list(pool.map(lambda e: e.start(), engines))
        for rank, engine in enumerate(engines):
            log = tmp / f"attach{rank}.log"  # forked from the preloaded forkserver (tests/helpers/preloaded.py)
            sidecar = AttachProcess(stack.config, log, stack.url, engine.url, rank, preloaded=True)
            sidecar.start(env=env)
            cleanup.callback(sidecar.stop)
        wait_for("engines attached", lambda: len(rollout_nodes(stack.url, TOKEN)) == len(engines), 60)
        yield engines


async def test_three_updates_reach_sglang_0_5_20_and_a_tp2_0_5_23_engine_bit_exact(
    stack: SyncStack, tmp_path: Path
) -> None:
    specs: list[dict[str, object]] = [
        {"version": "0.5.20", "api_key": TOKEN},
        {"version": "0.5.23", "api_key": TOKEN, "tp": 2},
    ]
    with attached(stack, tmp_path, specs) as engines:
        assert all(weight_version(e) == "default" for e in engines)
        model = TinyLlama()
        client = CheckpointEngineClient(
            coordinator_url=stack.url, role="actor", rank=0, model=model, model_name="llama", config=stack.config
        )
        await client.start()
        try:
            for update in (1, 2, 3):
                model.step()
                metrics = (await client.update_weights_for_rollout(rollout_only=True))["rollout"]
                assert metrics["weight_version"] == update and metrics["engines"] == 2
                assert metrics["group_rebuilt"] is (update == 1) and metrics["flattened"]
                for engine in engines:
                    assert engine_bits(engine) == model.served(), engine.version
                    assert weight_version(engine) == str(update)
        finally:
            await client.stop()


async def test_an_engine_killed_mid_update_fails_the_update_fast_naming_it_and_leaves_no_session_open(
    stack: SyncStack, tmp_path: Path
) -> None:
    config = stack.config.model_copy(update={"bucket_size_bytes": 64 * 1024})  # the trainer's (BucketSender)
    specs: list[dict[str, object]] = [{"version": "0.5.23", "api_key": TOKEN}] * 2
    with attached(stack, tmp_path, specs) as engines:
        survivor, victim = engines
        model = TinyLlama(extra=200)  # 200 buckets of 64 KiB: one request and one broadcast each
        client = CheckpointEngineClient(
            coordinator_url=stack.url, role="actor", rank=0, model=model, model_name="llama", config=config
        )
        await client.start()
        try:
            await client.update_weights_for_rollout(rollout_only=True)
            model.step()
            done = 'POST /update_weights_from_distributed HTTP/1.1" 200'
            before = victim.log_tail(10**7).count(done)
            update = asyncio.create_task(client.update_weights_for_rollout(rollout_only=True))
            five = lambda: victim.log_tail(10**7).count(done) >= before + 5  # noqa: E731
            await asyncio.to_thread(wait_for, "5 buckets of v2 loaded", five, 60)
            victim.stop()  # kill -9 of the whole engine (server and scheduler processes)
            started = time.monotonic()
            with pytest.raises(WeightSyncError) as failure:
                await asyncio.wait_for(update, timeout=60)
            assert time.monotonic() - started < config.sync.comm_timeout_seconds
            assert failure.value.member == "rollout_1"
            assert "left paused with a partial update" in str(failure.value)  # SGLang has no rollback
            assert survivor.post("/begin_weight_update", {}).json() == {"success": True, "message": "Success"}
            assert survivor.post("/end_weight_update", {}).status_code == 200  # it was not left mid-session
        finally:
            await client.stop()


async def test_an_engine_that_refuses_dcs_api_key_is_a_named_error(stack: SyncStack, tmp_path: Path) -> None:
    specs: list[dict[str, object]] = [{"version": "0.5.23", "api_key": "another-key"}]
    with attached(stack, tmp_path, specs, env={"DCS_ENGINE_API_KEY": "another-key"}) as engines:
        client = CheckpointEngineClient(
            coordinator_url=stack.url, role="actor", rank=0, model=TinyLlama(), model_name="llama", config=stack.config
        )
        await client.start()
        try:
            started = time.monotonic()
            with pytest.raises(EngineAuthRefused) as refused:
                await client.update_weights_for_rollout(rollout_only=True)
            assert refused.value.member == "rollout_0" and "--api-key" in str(refused.value)
            assert TOKEN not in str(refused.value) and "another-key" not in str(refused.value)
            assert time.monotonic() - started < 15
            assert weight_version(engines[0]) == "default"
        finally:
            await client.stop()


async def test_a_data_parallel_engine_is_refused_by_name_before_any_group_forms(
    stack: SyncStack, tmp_path: Path
) -> None:
    (tmp_path / "dp").mkdir()
    engine = SGLangEngine("0.5.23", tmp_path / "dp" / "engine.log", api_key=TOKEN, sglang_args=("--dp-size", "2"))
    try:
        engine.start()
        node = {"role_name": "rollout", "rank": 0, "ip": "127.0.0.1", "port": engine.port}
        headers = {"Authorization": f"Bearer {TOKEN}"}  # registered by hand: `dcs engine attach` refuses it
        httpx.post(f"{stack.url}/register", json=node, headers=headers, timeout=10).raise_for_status()
        client = CheckpointEngineClient(
            coordinator_url=stack.url, role="actor", rank=0, model=TinyLlama(), model_name="dp", config=stack.config
        )
        await client.start()
        try:
            with pytest.raises(EngineIncompatible) as refused:
                await client.update_weights_for_rollout(rollout_only=True)
            assert refused.value.member == "rollout_0" and "dp_size=2" in str(refused.value)
            assert "init_weights_update_group" not in engine.log_tail(10**7)  # no group was tried
        finally:
            await client.stop()
    finally:
        engine.stop()
