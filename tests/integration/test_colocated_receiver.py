"""Colocated updates into a real `dcs receiver` process on CPU: the trainer (this process) shares each bucket
through torch's shared-memory file and sends DCS's JSON frame; the receiver maps the file read-only and copies.
Also: an engine that never releases a bucket cannot keep the trainer's memory (deadline, bucket dropped), and
one update mixes a hung engine with a live one."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from pydantic import SecretStr

from dcs_tasks.config import DCSConfig
from dcs_tasks.engine_http import EngineHTTP
from dcs_tasks.sync.colocated import ColocatedEngine, ColocatedEngineFailed, ColocatedSender
from dcs_tasks.sync.receiving import tensor_sha256
from tests.distributed.sync_stack import ReceiverProcess, actor_client, auth_headers, sync_stack
from tests.helpers.procs import CoordinatorProcess

pytestmark = [pytest.mark.integration, pytest.mark.distributed]

TOKEN = "colocated-test-token-51c2"


@pytest.fixture
def receiver(dcs_config: DCSConfig, tmp_path: Path) -> Iterator[ReceiverProcess]:
    config = dcs_config.model_copy(update={"auth_token": SecretStr(TOKEN)})
    coordinator = CoordinatorProcess(config, tmp_path / "coordinator.log").start()
    config = config.model_copy(update={"coordinator_url": coordinator.url})
    proc = ReceiverProcess(config, coordinator.url, 0, tmp_path / "receiver.log")
    try:
        proc.start()
        yield proc
    finally:
        proc.stop()
        coordinator.stop()


def model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(64, 32, generator=g),
        "layer.0.bias": torch.randn(32, generator=g).to(torch.bfloat16),
        "layer.0.scale": torch.randn(7, generator=g).to(torch.float64),
        "layer.0.ids": torch.randint(0, 100, (9,), generator=g, dtype=torch.int16),
        "head.weight": torch.randn(16, 64, generator=g),
    }


def digest(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {name: tensor_sha256(t) for name, t in tensors.items()}


def receiver_state(proc: ReceiverProcess) -> tuple[int, dict[str, str]]:
    d = proc.digest()
    return d.weight_version, d.tensors


def test_colocated_updates_reach_dcs_receiver_bit_exact_with_reused_buckets(receiver: ReceiverProcess) -> None:
    async def run() -> None:
        http = EngineHTTP(headers=auth_headers(TOKEN))
        sender = ColocatedSender(torch.device("cpu"), bucket_size_bytes=4096, http=http, release_seconds=30)
        try:
            for v in (1, 2):
                state = model(v)
                engine = ColocatedEngine("rollout_0", receiver.url, "dcs")
                report = await sender.update(state, [engine], v)
                assert report.buckets >= 2 and report.dropped_buckets == 0
                assert report.bytes == sum(t.numel() * t.element_size() for t in state.values())
                assert receiver_state(receiver) == (v, digest(state))
                pool = sender._pool
                assert pool is not None
                names = [s.shm.name for s in pool.slots if s.shm is not None]
                if v == 1:
                    first = names
                else:
                    assert names == first, "the two shared buckets are reused, not reallocated"
        finally:
            await http.aclose()

    asyncio.run(run())


def test_a_frame_naming_other_memory_is_refused_and_nothing_changes(receiver: ReceiverProcess) -> None:
    h = auth_headers(TOKEN)
    assert httpx.post(f"{receiver.url}/begin_weight_update", json={}, headers=h).status_code == 200
    frame = {
        "format": "dcs-ipc-frame", "v": 1, "kind": "shm", "bucket": 0, "generation": 0, "nbytes": 16,
        "names": ["w"], "dtypes": ["float32"], "shapes": [[4]], "weight_version": 1, "last": True,
        "shm": {"name": "/../../etc/passwd", "offset": 0}, "cuda": None,
    }  # fmt: skip
    answer = httpx.post(f"{receiver.url}/update_weights_from_ipc_frame", json=frame, headers=h)
    assert answer.status_code == 400 and "not a torch shared-memory file name" in answer.json()["message"]
    frame["shm"] = {"name": "/torch_1_1_1", "offset": 0}  # well-formed, no such file
    answer = httpx.post(f"{receiver.url}/update_weights_from_ipc_frame", json=frame, headers=h)
    assert answer.status_code == 400 and "cannot be opened" in answer.json()["message"]
    answer = httpx.post(f"{receiver.url}/update_weights_from_ipc_frame", json=frame)  # no token
    assert answer.status_code == 401
    frame["pickle"] = "gASV"  # an unknown field
    answer = httpx.post(f"{receiver.url}/update_weights_from_ipc_frame", json=frame, headers=h)
    assert answer.status_code == 400 and "unknown fields ['pickle']" in answer.json()["message"]
    assert receiver_state(receiver) == (0, {})


@pytest.fixture
def silent_engine() -> Iterator[str]:
    """An engine that answers its session calls but never answers a bucket: one that opened a bucket and never
    lets it go."""
    stop = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.path == "/update_weights_from_ipc_frame":
                stop.wait(60)  # holds the bucket
                return
            body = b'{"success": true, "message": "Success"}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        stop.set()
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_an_engine_that_never_releases_is_failed_and_its_bucket_dropped(
    receiver: ReceiverProcess, silent_engine: str
) -> None:
    async def run() -> None:
        http = EngineHTTP(headers=auth_headers(TOKEN))
        sender = ColocatedSender(
            torch.device("cpu"), bucket_size_bytes=1 << 20, http=http, release_seconds=1.5, call_seconds=1.5
        )
        state = model(3)
        live = ColocatedEngine("rollout_0", receiver.url, "dcs")
        hung = ColocatedEngine("rollout_1", silent_engine, "dcs")
        try:
            await sender.update(state, [live], 1)  # the pool exists and is shared
            pool = sender._pool
            assert pool is not None
            before = [s.shm.name for s in pool.slots if s.shm is not None]
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            with pytest.raises(ColocatedEngineFailed, match="rollout_1"):
                await sender.update(model(4), [live, hung], 2)
            assert loop.time() - t0 < 15
            assert pool.dropped == 1
            after = [s.shm.name for s in pool.slots if s.shm is not None]
            assert after[0] != before[0] and after[1] == before[1]
            assert not os.path.exists("/dev/shm" + before[0]), "the dropped bucket's file is gone from the trainer"
            assert pool.nbytes == 2 * pool.bucket_bytes, "memory stays bounded: two buckets"
        finally:
            await http.aclose()
        assert receiver_state(receiver) == (2, digest(model(4))), "the live engine of the same update completed"

    asyncio.run(run())


class ColocatedReceiverProcess(ReceiverProcess):
    """`dcs receiver ... --colocated-with RANK`: registered as colocated with that trainer rank (on CPU)."""

    def __init__(self, *args: Any, trainer_rank: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.trainer_rank = trainer_rank

    def spawn(self, *args: str, **kwargs: Any) -> None:
        super().spawn(*args, "--colocated-with", str(self.trainer_rank), "--colocated-device", "cpu", **kwargs)


def test_one_update_mixes_a_remote_and_a_colocated_receiver(dcs_config: DCSConfig, tmp_path: Path) -> None:
    """The trainer's `update_weights_for_rollout` broadcasts to the remote receiver through the group and hands
    the colocated one its buckets by handle, with the same version; the colocated one never joins the group."""
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.LayerNorm(48), torch.nn.Linear(48, 8))
    with sync_stack(dcs_config, tmp_path, receivers=1) as stack:
        colocated = ColocatedReceiverProcess(stack.config, stack.url, 1, tmp_path / "receiver-colocated.log")
        colocated.start()
        stack.receivers.append(colocated)
        remote = stack.receivers[0]

        async def run() -> list[dict[str, Any]]:
            out = []
            async with actor_client(stack, model, "tiny") as client:
                for _ in range(2):
                    with torch.no_grad():
                        for p in model.parameters():
                            p.add_(torch.randn_like(p))
                    out.append(await client.update_weights_for_rollout(rollout_only=True))
                    want = digest({k: v.detach() for k, v in model.state_dict().items()})
                    version = out[-1]["rollout"]["weight_version"]
                    assert receiver_state(remote) == (version, want)
                    assert receiver_state(colocated) == (version, want)
            return out

        metrics = asyncio.run(run())
    assert [m["rollout"]["weight_version"] for m in metrics] == [1, 2]
    assert [m["colocated"]["weight_version"] for m in metrics] == [1, 2]
    assert all(m["rollout"]["engines"] == 1 and m["colocated"]["engines"] == 1 for m in metrics)
    size = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    assert metrics[0]["colocated"]["bytes"] == size
