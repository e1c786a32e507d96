"""A trainer pushes weights into engines made of vLLM's own code (tests/vllm_engine: vLLM's CLI parser, HTTP app
with its dev-mode RL router, `AsyncLLM`'s and the GPU `Worker`'s weight methods, `WeightTransferEngineFactory`,
the NCCL engine's update handling and vLLM's layerwise reload; the transfer engine is DCS's plugin, backend "dcs"
over gloo, installed with `pip install plugins/vllm-dcs` and found by vLLM through its entry point),
registered with `dcs engine attach --kind vllm`, beside an SGLang-protocol engine (`dcs receiver`), with the
README's API only. Weights are read back whole from the engines' workers and
compared bit for bit; versions through vLLM's `/weight_info`.
"""

from __future__ import annotations

import asyncio
import multiprocessing.forkserver
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
import torch
from pydantic import SecretStr

from dcs_tasks.client.engine import CheckpointEngineClient
from dcs_tasks.config import DCSConfig, RoleInfo
from dcs_tasks.coordinator_api import CoordinatorAPI
from dcs_tasks.errors import VLLMBackendMismatch, WeightSyncError
from tests.distributed.sync_stack import SyncStack, sync_stack
from tests.helpers.preloaded import _forkserver
from tests.integration.engine_attach_support import AttachProcess, rollout_nodes, wait_for
from tests.vllm_engine.harness import VLLMEngine, installed
from tests.vllm_engine.shapes import TrainerModel

pytestmark = [pytest.mark.integration, pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(900)]
TOKEN = "vllm-engines-token-5c1f"
if not installed():
    pytestmark.append(pytest.mark.skip(reason="vLLM not installed under .vllm/ (make vllm-engines)"))


def bits(tensor: torch.Tensor) -> bytes:
    return tensor.detach().contiguous().view(torch.uint8).numpy().tobytes()


def served(model: torch.nn.Module) -> dict[str, bytes]:
    return {name: bits(t) for name, t in model.state_dict().items()}


def mismatched(engine: VLLMEngine, model: torch.nn.Module) -> list[str]:
    """Names whose bytes in the engine differ from the trainer's (or that either side lacks)."""
    held = {name: bits(t) for name, t in engine.weights().items()}
    want = served(model)
    return sorted(name for name in held.keys() | want.keys() if held.get(name) != want.get(name))


@pytest.fixture
def config(dcs_config: DCSConfig) -> DCSConfig:
    return dcs_config.model_copy(
        update={
            "auth_token": SecretStr(TOKEN),
            "comm_timeout_seconds": 30.0,
            "group_init_timeout_seconds": 60.0,
            "max_retries": 0,
            "retry_delay_seconds": 0.2,
        }
    )


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, VLLMEngine]]:
    """Every engine the tests here use, started at once (vLLM's imports dominate): a TP=2 and a TP=1 engine,
    one without dev mode, one on vLLM's own `nccl` weight-transfer backend instead of DCS's plugin."""
    tmp = tmp_path_factory.mktemp("vllm")
    specs = {
        "tp2": {"tp": 2},
        "tp1": {},
        "no_dev_mode": {"dev_mode": False},
        "vllm_nccl": {"backend": "nccl"},
    }
    made = {}
    for name, spec in specs.items():
        (tmp / name).mkdir()
        made[name] = VLLMEngine(tmp / name / "engine.log", api_key=TOKEN, **spec)  # type: ignore[arg-type]
    start_preloaded_forkserver()  # the attach sidecars' and receivers' (imports while the engines start)
    with ExitStack() as cleanup:
        for engine in made.values():
            cleanup.callback(engine.stop)
        with ThreadPoolExecutor(len(made)) as pool:
            list(pool.map(lambda e: e.start(), made.values()))
        yield made


def start_preloaded_forkserver() -> None:
    """Start the forkserver of tests/helpers/preloaded.py (its imports take seconds) without waiting for it."""
    _forkserver()  # sets its preload list
    multiprocessing.forkserver.ensure_running()


@contextmanager
def attached(stack: SyncStack, tmp: Path, engines: list[VLLMEngine], first_rank: int = 0) -> Iterator[None]:
    with ExitStack() as cleanup:
        for i, engine in enumerate(engines):
            rank = first_rank + i
            sidecar = AttachProcess(
                stack.config, tmp / f"attach{rank}.log", stack.url, engine.url, rank, preloaded=True
            )
            sidecar.start("--kind", "vllm")
            cleanup.callback(sidecar.stop)
        want = first_rank + len(engines)
        wait_for("engines attached", lambda: len(rollout_nodes(stack.url, TOKEN)) >= want, 60)
        yield


async def test_three_updates_reach_a_tp2_and_a_tp1_vllm_engine_beside_an_sglang_protocol_engine_bit_exact(
    config: DCSConfig, tmp_path: Path, engines: dict[str, VLLMEngine]
) -> None:
    tp2, tp1 = engines["tp2"], engines["tp1"]
    config = config.model_copy(update={"bucket_size_bytes": 256 * 1024})
    with sync_stack(config, tmp_path) as stack, attached(stack, tmp_path, [tp2, tp1]):
        receiver = stack.add_receiver(2)  # SGLang's protocol, side by side in the same group
        nodes = rollout_nodes(stack.url, TOKEN)
        assert [nodes[r].metadata.get("engine") for r in (0, 1)] == ["vllm", "vllm"]
        assert nodes[0].metadata["tp_size"] == 2 and nodes[0].metadata["engine_version"] == "0.33.0"
        assert tp2.weight_version() == "default"
        # an update left active on tp1, as by a trainer that died mid-update: vLLM refuses a second start
        assert tp1.post("/start_weight_update").status_code == 200
        assert "already active" in tp1.post("/start_weight_update").text
        model = TrainerModel()
        client = CheckpointEngineClient(
            coordinator_url=stack.url, role="actor", rank=0, model=model, model_name="llama", config=stack.config
        )
        await client.start()
        try:
            for update in (1, 2, 3):
                model.step()
                metrics = (await client.update_weights_for_rollout(rollout_only=True))["rollout"]
                assert metrics["weight_version"] == update and metrics["engines"] == 3
                assert metrics["group_rebuilt"] is (update == 1) and metrics["flattened"]
                assert metrics["buckets"] > 3
                for engine in (tp2, tp1):
                    assert mismatched(engine, model) == []
                    assert engine.weight_version() == str(update)
                    assert engine.get("/is_paused").json() == {"is_paused": False}
                assert receiver.digest().weight_version == update
        finally:
            await client.stop()


async def test_an_engine_without_dev_mode_is_refused_naming_what_to_turn_on(
    config: DCSConfig, tmp_path: Path, engines: dict[str, VLLMEngine]
) -> None:
    with sync_stack(config, tmp_path) as stack:
        sidecar = AttachProcess(
            stack.config, tmp_path / "attach.log", stack.url, engines["no_dev_mode"].url, 0, preloaded=True
        )
        sidecar.start("--kind", "vllm")
        try:
            assert sidecar.wait_exit(120) == 1
        finally:
            sidecar.stop()
        log = (tmp_path / "attach.log").read_text()
        assert "VLLMDevModeOff" in log and "VLLM_SERVER_DEV_MODE=1" in log
        assert rollout_nodes(stack.url, TOKEN) == {}
        assert TOKEN not in log


async def test_an_engine_not_on_the_dcs_backend_is_refused_before_any_join_saying_what_to_start(
    config: DCSConfig, tmp_path: Path, engines: dict[str, VLLMEngine]
) -> None:
    """`vllm serve --weight-transfer-config '{"backend": "nccl"}'` (vLLM's own engine): `dcs engine attach`
    refuses to register it, and a trainer that finds it registered anyway refuses it before any join, both
    reading the backend from the engine's dev-mode /server_info."""
    wrong = engines["vllm_nccl"]
    with sync_stack(config, tmp_path) as stack:
        sidecar = AttachProcess(stack.config, tmp_path / "attach.log", stack.url, wrong.url, 0, preloaded=True)
        sidecar.start("--kind", "vllm")
        try:
            assert sidecar.wait_exit(180) == 1
        finally:
            sidecar.stop()
        log = (tmp_path / "attach.log").read_text()
        assert "VLLMBackendMismatch" in log and "weight-transfer backend 'nccl'" in log
        assert '--weight-transfer-config \'{"backend": "dcs"}\'' in log and "pip install plugins/vllm-dcs" in log
        assert rollout_nodes(stack.url, TOKEN) == {}

        node = RoleInfo(role_name="rollout", rank=0, ip="127.0.0.1", port=wrong.port, metadata={"engine": "vllm"})
        async with CoordinatorAPI(stack.url, TOKEN) as api:
            await api.register(node)  # as a registration made without the attach sidecar's check
            client = CheckpointEngineClient(
                coordinator_url=stack.url, role="actor", rank=0, model=TrainerModel(), model_name="l",
                config=stack.config,
            )  # fmt: skip
            await client.start()
            try:
                started = time.monotonic()
                with pytest.raises(VLLMBackendMismatch) as refused:
                    await client.update_weights_for_rollout(rollout_only=True)
                assert refused.value.member == "rollout_0" and '{"backend": "dcs"}' in str(refused.value)
                assert time.monotonic() - started < 60
                assert wrong.weight_version() == "default"
                assert "init_weight_transfer_engine" not in wrong.log_tail(200_000)  # no join was sent
            finally:
                await client.stop()


async def test_an_engine_killed_mid_update_fails_the_update_naming_it_and_the_survivor_takes_the_next(
    config: DCSConfig, tmp_path: Path, engines: dict[str, VLLMEngine]
) -> None:
    survivor, victim = engines["tp2"], engines["tp1"]  # the last test: the victim is gone afterwards
    # 40+ buckets, one request each; the update fails when the survivor's share of the broken collective times
    # out (comm_timeout_seconds: 10 s, hundreds of times what one 64 KiB bucket takes on a loaded machine)
    config = config.model_copy(update={"bucket_size_bytes": 64 * 1024, "comm_timeout_seconds": 10.0})
    with sync_stack(config, tmp_path) as stack, attached(stack, tmp_path, [survivor, victim]):
        model = TrainerModel()
        client = CheckpointEngineClient(
            coordinator_url=stack.url, role="actor", rank=0, model=model, model_name="l", config=stack.config
        )
        await client.start()
        try:
            first = (await client.update_weights_for_rollout(rollout_only=True))["rollout"]["weight_version"]
            model.step()
            done = 'POST /update_weights HTTP/1.1" 200'
            before = victim.log_tail(10**7).count(done)
            update = asyncio.create_task(client.update_weights_for_rollout(rollout_only=True))
            five = lambda: victim.log_tail(10**7).count(done) >= before + 5  # noqa: E731
            await asyncio.to_thread(wait_for, "5 buckets loaded", five, 60)
            victim.stop()  # kill -9 of the server and its worker processes
            started = time.monotonic()
            with pytest.raises(WeightSyncError) as failure:
                await asyncio.wait_for(update, timeout=90)
            assert time.monotonic() - started < config.sync.comm_timeout_seconds + 10
            # the victim's death also breaks the survivor's share of the collective: whichever answer comes first
            # is the member named (a fresh-clone run saw rollout_0's 500 first); the victim is named either way
            assert failure.value.member in ("rollout_1", "rollout_0"), failure.value
            assert "rollout_1" in str(failure.value), failure.value
            assert "left paused with a partial update" in str(failure.value)
            assert survivor.get("/is_paused").json() == {"is_paused": True}  # it holds part of v2
            wait_for("the victim unregistered", lambda: 1 not in rollout_nodes(stack.url, TOKEN), 90)
            metrics = (await client.update_weights_for_rollout(rollout_only=True))["rollout"]
            assert metrics["engines"] == 1 and metrics["weight_version"] == first + 1  # the failed one is not counted
            assert mismatched(survivor, model) == [] and survivor.weight_version() == str(first + 1)
            assert survivor.get("/is_paused").json() == {"is_paused": False}
        finally:
            await client.stop()
