"""A trainer pushes weights into engines running SGLang's own code (tests/sglang_engine: SGLang's HTTP app,
API-key middleware, tokenizer manager, ZMQ, TP scheduler processes and weight-update stack; only the GPU
model and batcher are replaced), registered through `dcs engine attach`, with the README's API only.

Versions: 0.5.20 (no begin/end session API) and 0.5.23 (sessions), from `.sglang/<version>` (Makefile
`sglang-engines`). Weights are read back through SGLang's own `/get_weights_by_name` (float lists of the full,
TP-gathered tensors: equal values of float32/bfloat16/float16 tensors are equal bits, signed zeros aside).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest
import torch
from pydantic import SecretStr

from dcs_tasks.client.engine import CheckpointEngineClient
from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import EngineAuthRefused, WeightSyncError
from tests.distributed.sync_stack import SyncStack, sync_stack
from tests.helpers.ports import free_port
from tests.helpers.procs import REPO
from tests.integration.engine_attach_support import AttachProcess, rollout_nodes, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.distributed, pytest.mark.slow]
TOKEN = "sglang-engines-token-7d2e"
VERSIONS = ("0.5.20", "0.5.23")
HIDDEN, INTERMEDIATE, VOCAB = 8, 12, 16  # tests/sglang_engine/tiny_model.py
START_TIMEOUT = 240.0

missing = [f"SGLang {v} under .sglang/" for v in VERSIONS if not (REPO / ".sglang" / v / "sglang").is_dir()]
missing += [] if (REPO / "tests" / "sglang_engine" / "serve.py").is_file() else ["the tests/sglang_engine harness"]
if missing:
    pytestmark.append(pytest.mark.skip(reason=f"{', '.join(missing)} not installed (make sglang-engines)"))


class SGLangEngine:
    """`python -m tests.sglang_engine.serve` in its own session (so kill() takes its scheduler processes too)."""

    def __init__(self, version: str, log_path: Path, tp: int = 1, api_key: str | None = TOKEN) -> None:
        self.version, self.tp, self.api_key, self.log_path = version, tp, api_key, log_path
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> SGLangEngine:
        cmd = [sys.executable, "-m", "tests.sglang_engine.serve", "--sglang-dir", f".sglang/{self.version}"]
        cmd += ["--port", str(self.port), "--tp", str(self.tp), *(["--api-key", self.api_key] if self.api_key else [])]
        env = {k: v for k, v in os.environ.items() if not k.startswith("DCS_")}
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        return self

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        def up() -> bool:
            assert self.proc is not None and self.proc.poll() is None, f"engine exited: {self.log_tail()}"
            return httpx.get(f"{self.url}/health", timeout=5).status_code == 200

        wait_for(f"SGLang {self.version} engine on {self.port}", up, timeout, poll=0.5)

    def post(self, path: str, body: dict[str, object]) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.post(f"{self.url}{path}", json=body, headers=headers, timeout=30)

    def weights(self, names: list[str]) -> dict[str, object]:
        """SGLang's `/get_weights_by_name` of each name: the whole tensor as (nested) float lists."""
        return {n: self.post("/get_weights_by_name", {"name": n, "truncate_size": 10**6}).json() for n in names}

    def weight_version(self) -> str:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return str(httpx.get(f"{self.url}/model_info", headers=headers, timeout=30).json()["weight_version"])

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path.exists() else ""

    def kill(self) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(30)
            self.proc = None


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

    def served(self) -> dict[str, object]:
        """What SGLang's /get_weights_by_name should answer for each engine parameter."""
        return {n: t.float().tolist() for n, t in self.state_dict().items() if not n.startswith("extra.")}

    def step(self) -> None:
        with torch.no_grad():
            for p in self.parameters():
                p.add_(torch.randn_like(p.float()).to(p.dtype))


@pytest.fixture
def config(dcs_config: DCSConfig) -> DCSConfig:
    return dcs_config.model_copy(
        update={
            "auth_token": SecretStr(TOKEN),
            "comm_timeout_seconds": 30.0,
            "group_init_timeout_seconds": 60.0,
            "max_retries": 1,
            "retry_delay_seconds": 0.2,
        }
    )


@contextmanager
def attached(
    stack: SyncStack, tmp: Path, engines: list[SGLangEngine], env: dict[str, str] | None = None
) -> Iterator[list[SGLangEngine]]:
    """Start the engines (concurrently), wait until they serve, attach each at its list index as its rank."""
    with ExitStack() as cleanup:
        for engine in engines:
            cleanup.callback(engine.kill)
            engine.start()
        for engine in engines:
            engine.wait_ready()
        for rank, engine in enumerate(engines):
            sidecar = AttachProcess(stack.config, tmp / f"attach{rank}.log", stack.url, engine.url, rank)
            sidecar.start(env=env)
            cleanup.callback(sidecar.stop)
        wait_for("engines attached", lambda: len(rollout_nodes(stack.url, TOKEN)) == len(engines), 60)
        yield engines


async def test_three_updates_reach_sglang_0_5_20_and_a_tp2_0_5_23_engine_bit_exact(
    config: DCSConfig, tmp_path: Path
) -> None:
    engines = [SGLangEngine("0.5.20", tmp_path / "e0.log"), SGLangEngine("0.5.23", tmp_path / "e1.log", tp=2)]
    with sync_stack(config, tmp_path) as stack, attached(stack, tmp_path, engines):
        assert all(e.weight_version() == "default" for e in engines)
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
                    assert engine.weights(list(model.served())) == model.served(), engine.version
                    assert engine.weight_version() == str(update)
        finally:
            await client.stop()


async def test_an_engine_killed_mid_update_fails_the_update_fast_naming_it_and_leaves_no_session_open(
    config: DCSConfig, tmp_path: Path
) -> None:
    config = config.model_copy(update={"bucket_size_bytes": 64 * 1024})
    engines = [SGLangEngine("0.5.23", tmp_path / "e0.log"), SGLangEngine("0.5.23", tmp_path / "e1.log")]
    with sync_stack(config, tmp_path) as stack, attached(stack, tmp_path, engines):
        survivor, victim = engines
        model = TinyLlama(extra=200)  # 200 buckets of 64 KiB: one request and one broadcast each
        client = CheckpointEngineClient(
            coordinator_url=stack.url, role="actor", rank=0, model=model, model_name="llama", config=stack.config
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
            victim.kill()
            started = time.monotonic()
            with pytest.raises(WeightSyncError) as failure:
                await asyncio.wait_for(update, timeout=60)
            assert time.monotonic() - started < config.comm_timeout_seconds
            assert failure.value.member == "rollout_1"
            assert "left paused with a partial update" in str(failure.value)  # SGLang has no rollback
            assert survivor.post("/begin_weight_update", {}).json() == {"success": True, "message": "Success"}
            assert survivor.post("/end_weight_update", {}).status_code == 200  # it was not left mid-session
        finally:
            await client.stop()


async def test_an_engine_that_refuses_dcs_api_key_is_a_named_error(config: DCSConfig, tmp_path: Path) -> None:
    engines = [SGLangEngine("0.5.23", tmp_path / "e0.log", api_key="another-key")]
    with (
        sync_stack(config, tmp_path) as stack,
        attached(stack, tmp_path, engines, env={"DCS_ENGINE_API_KEY": "another-key"}),
    ):
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
            assert engines[0].weight_version() == "default"
        finally:
            await client.stop()
