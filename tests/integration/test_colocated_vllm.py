"""Colocated updates into vLLM's own code on CPU (tests/vllm_engine): the engine is started with DCS's plugin
backend "dcs-ipc" (`vllm serve --weight-transfer-config '{"backend": "dcs-ipc"}'`, the plugin installed with pip
and found through its entry point); the trainer (this process) shares each bucket through torch's shared-memory
file and posts vLLM's own `/update_weights` with DCS's JSON frame; vLLM's worker hands it to the plugin, which
maps the file read-only, copies, and loads through vLLM's layerwise reload. Also: one update through the
trainer's client mixes this colocated engine with a remote `dcs receiver` (a process group); a bad frame, or
vLLM's own pickled IPC payload, is refused; `dcs engine attach` checks the engine's backend matches how it is
registered. Slow: a TP=2 engine starts (the first vLLM engine of a test process imports vLLM: 15-30 s)."""

from __future__ import annotations

import asyncio
import json
import multiprocessing.forkserver
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from pydantic import SecretStr

from dcs_tasks.client.engine import CheckpointEngineClient
from dcs_tasks.config import DCSConfig
from dcs_tasks.engine_http import EngineHTTP
from dcs_tasks.sync.colocated import ColocatedEngine, ColocatedSender
from dcs_tasks.sync.ipcframe import frame_for
from dcs_tasks.sync.receiving import tensor_sha256
from tests.distributed.sync_stack import sync_stack
from tests.helpers.preloaded import _forkserver
from tests.integration.engine_attach_support import AttachProcess, rollout_nodes, wait_for
from tests.vllm_engine.harness import VLLMEngine, installed
from tests.vllm_engine.shapes import TrainerModel

pytestmark = [pytest.mark.integration, pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(900)]
TOKEN = "colocated-vllm-token-8e2d"
if not installed():
    pytestmark.append(pytest.mark.skip(reason="vLLM not installed under .vllm/ (make vllm-engines)"))


def bits(tensor: torch.Tensor) -> bytes:
    return tensor.detach().contiguous().view(torch.uint8).numpy().tobytes()


def mismatched(engine: VLLMEngine, state: dict[str, torch.Tensor]) -> list[str]:
    held = {name: bits(t) for name, t in engine.weights().items()}
    want = {name: bits(t) for name, t in state.items()}
    return sorted(name for name in held.keys() | want.keys() if held.get(name) != want.get(name))


def fresh_post(engine: VLLMEngine, path: str, body: dict[str, Any]) -> httpx.Response:
    """One POST on a connection of its own: uvicorn closes a connection after a handler raised, unannounced."""
    headers = {"Authorization": f"Bearer {TOKEN}"}
    return httpx.post(engine.url + path, json=body, headers=headers, timeout=60.0)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMEngine]:
    tmp = tmp_path_factory.mktemp("vllm-ipc")
    made = VLLMEngine(tmp / "engine.log", tp=2, api_key=TOKEN, backend="dcs-ipc")
    _forkserver()  # tests/helpers/preloaded.py's (the sidecars' and the receiver's): it imports while the engine starts
    multiprocessing.forkserver.ensure_running()
    try:
        made.start()
        yield made
    finally:
        made.stop()


def test_colocated_updates_reach_a_tp2_vllm_engine_bit_exact_and_a_bad_frame_is_refused(engine: VLLMEngine) -> None:
    info = engine.get("/server_info?config_format=json").json()
    assert info["vllm_config"]["weight_transfer_config"]["backend"] == "dcs-ipc"

    async def run() -> None:
        http = EngineHTTP(headers={"Authorization": f"Bearer {TOKEN}"})
        sender = ColocatedSender(torch.device("cpu"), bucket_size_bytes=64 * 1024, http=http, release_seconds=60)
        model = TrainerModel()
        try:
            for version in (1, 2):
                model.step()
                state = {n: t.detach().clone() for n, t in model.state_dict().items()}
                target = ColocatedEngine("rollout_0", engine.url, "vllm", tp_size=2, pause_mode="abort")
                report = await sender.update(state, [target], version)
                assert report.buckets >= 3 and report.dropped_buckets == 0 and not report.failed
                assert report.bytes == sum(t.numel() * t.element_size() for t in state.values())
                assert mismatched(engine, state) == []  # both TP ranks: the sharded weight joined
                assert engine.weight_version() == str(version)
                assert engine.get("/is_paused").json() == {"is_paused": False}
            pool = sender._pool
            assert pool is not None and pool.dropped == 0  # the same two buckets, reused

            # bad input: refused by the plugin's reader before any memory is opened; vLLM ends the session (its
            # layerwise reload holds the model until a complete update), and the next update loads everything
            layout = sender.plan(state)[0]
            slot = pool.slots[0]
            good = json.loads(frame_for("shm", 0, slot.generation, layout, 3, True, slot.shm).encode())
            bad_name = good | {"shm": {"name": "/../../etc/passwd", "offset": 0}}
            unknown = good | {"pickle": "gASV"}
            vllm_own = {"names": ["a"], "dtype_names": ["float32"], "shapes": [[1]], "ipc_handles_pickled": "gASV"}
            for body, says in (
                ({"frame": bad_name}, "not a torch shared-memory file name"),
                ({"frame": unknown}, "unknown fields ['pickle']"),
                (vllm_own, "Invalid update_info"),
            ):
                assert fresh_post(engine, "/start_weight_update", {}).status_code == 200
                answer = fresh_post(engine, "/update_weights", {"update_info": body})
                assert answer.status_code == 500 and says in answer.text, answer.text
                # vLLM ended the session on the failure: a finish is refused, the next start is not
                assert fresh_post(engine, "/finish_weight_update", {}).status_code == 500
            model.step()
            state = {n: t.detach().clone() for n, t in model.state_dict().items()}
            target = ColocatedEngine("rollout_0", engine.url, "vllm", tp_size=2, pause_mode="abort")
            await sender.update(state, [target], 4)
            assert mismatched(engine, state) == [] and engine.weight_version() == "4"
        finally:
            await http.aclose()

    try:
        asyncio.run(run())
    except BaseException:
        print(engine.log_tail(20000))
        raise


async def test_one_update_mixes_a_colocated_vllm_engine_and_a_remote_dcs_receiver(
    dcs_config: DCSConfig, tmp_path: Path, engine: VLLMEngine
) -> None:
    config = dcs_config.model_copy(
        update={"auth_token": SecretStr(TOKEN), "comm_timeout_seconds": 30.0, "bucket_size_bytes": 64 * 1024}
    )
    with sync_stack(config, tmp_path) as stack:
        # registered as remote, a "dcs-ipc" engine is refused: it joins no group
        remote = AttachProcess(stack.config, tmp_path / "attach-remote.log", stack.url, engine.url, 0, preloaded=True)
        remote.start("--kind", "vllm")
        try:
            assert remote.wait_exit(180) == 1
        finally:
            remote.stop()
        log = (tmp_path / "attach-remote.log").read_text()
        assert "VLLMBackendMismatch" in log and "not 'dcs' for a remote engine" in log
        assert '--weight-transfer-config \'{"backend": "dcs"}\'' in log

        sidecar = AttachProcess(stack.config, tmp_path / "attach.log", stack.url, engine.url, 0, preloaded=True)
        sidecar.start("--kind", "vllm", "--colocated-with", "0", "--colocated-device", "cpu")
        try:
            wait_for("engine attached", lambda: 0 in rollout_nodes(stack.url, TOKEN), 120)
            node = rollout_nodes(stack.url, TOKEN)[0]
            assert node.metadata["engine"] == "vllm" and node.metadata["colocated"]["device"] == "cpu"
            receiver = stack.add_receiver(1)  # remote: the process group
            model = TrainerModel()
            client = CheckpointEngineClient(
                coordinator_url=stack.url, role="actor", rank=0, model=model, model_name="l", config=stack.config
            )
            await client.start()
            try:
                for update in (1, 2):
                    model.step()
                    metrics = await client.update_weights_for_rollout(rollout_only=True)
                    assert metrics["rollout"]["engines"] == 1  # the receiver only: the vLLM engine is colocated
                    assert metrics["colocated"]["weight_version"] == update
                    state = {n: t.detach() for n, t in model.state_dict().items()}
                    assert mismatched(engine, state) == []
                    assert engine.weight_version() == str(update)
                    digest = receiver.digest()
                    assert digest.weight_version == update
                    assert digest.tensors == {n: tensor_sha256(t) for n, t in state.items()}
            finally:
                await client.stop()
        finally:
            sidecar.stop()
