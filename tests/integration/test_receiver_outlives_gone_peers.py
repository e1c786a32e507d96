"""A real `dcs receiver` outlives the clients and peers that go away around it.

The defect: when the trainer found an engine replaced, it cancelled the pause/begin calls still in flight on the
surviving receiver; when the receiver then wrote its answer to the closed connection, the kernel killed it by
SIGPIPE (the `dcs` entry point restores SIGPIPE's default action), with no log line and no faulthandler dump,
and the update failed at its next probe of that receiver. These tests provoke exactly that (clients that give
up mid-answer, many times over), then check that the receiver still answers /health and still joins a new group
and receives an update; and that SIGTERM ends a receiver cleanly (unregistered, groups left, exit status 0)
instead of by the signal's default action.
"""

from __future__ import annotations

import asyncio
import random
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from dcs_tasks.backends.base import GroupSpec
from dcs_tasks.backends.device_direct import DeviceDirectBackend
from dcs_tasks.config import DCSConfig
from dcs_tasks.sync.receiving import tensor_sha256
from tests.distributed.sync_stack import ReceiverProcess, alive_ranks, auth_headers, sync_stack
from tests.helpers.ports import free_port

pytestmark = [pytest.mark.integration, pytest.mark.distributed]

ABANDONED_REQUESTS = 3000  # the receiver died within a few hundred of these before the fix
ABANDON_BOUND_SECONDS = 120.0  # a bound on the loop, not an assertion on its speed
SESSION_PATHS = (b"/pause_generation", b"/begin_weight_update", b"/end_weight_update")


async def abandoned_request(port: int, path: bytes) -> None:
    """POST `path`, then close the connection within a few milliseconds, whether or not the answer came."""
    _reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = b"POST %s HTTP/1.1\r\nHost: receiver\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
    writer.write(head % path)
    await asyncio.sleep(random.random() * 0.004)
    writer.close()


async def abandon_requests(receiver: ReceiverProcess, count: int) -> int:
    """Send up to `count` abandoned requests, 20 at a time; stops early when the receiver has exited."""
    sent, deadline = 0, time.monotonic() + ABANDON_BOUND_SECONDS
    assert receiver.proc is not None
    while sent < count and time.monotonic() < deadline and receiver.proc.poll() is None:
        batch = [abandoned_request(receiver.port, random.choice(SESSION_PATHS)) for _ in range(20)]
        await asyncio.gather(*batch, return_exceptions=True)
        sent += len(batch)
    return sent


def exit_status(receiver: ReceiverProcess) -> str:
    assert receiver.proc is not None
    code = receiver.proc.poll()
    if code is None:
        return "alive"
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with {code}"


def join_and_push(receiver: ReceiverProcess, config: DCSConfig, group_name: str, version: int) -> torch.Tensor:
    """This process as rank 0 of a new 2-member gloo group with `receiver`, one update of one tensor through
    SGLang's calls (init, begin, update, end); returns the tensor sent."""
    headers = auth_headers(config.token())
    port, sent = free_port(), torch.randn(64, 8)
    trainer = DeviceDirectBackend(timeout_seconds=60.0, group_init_timeout_seconds=60.0)
    init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2}
    init |= {"group_name": group_name, "backend": "gloo"}
    bucket = {"names": ["w"], "dtypes": ["float32"], "shapes": [[64, 8]], "group_name": group_name}
    bucket |= {"weight_version": str(version), "flush_cache": True}
    with httpx.Client(base_url=receiver.url, headers=headers, timeout=60) as http:
        forming = threading.Thread(target=trainer.create_group, args=(GroupSpec(group_name, "127.0.0.1", port, 2, 0),))
        forming.start()
        joined = http.post("/init_weights_update_group", json=init)
        forming.join(60)
        assert joined.status_code == 200, joined.text
        assert http.post("/begin_weight_update", json={}).status_code == 200
        sending = threading.Thread(target=trainer.broadcast, args=(sent.clone(), 0, group_name))
        sending.start()
        updated = http.post("/update_weights_from_distributed", json=bucket)
        sending.join(60)
        assert updated.status_code == 200, updated.text
        assert http.post("/end_weight_update", json={}).status_code == 200
    trainer.close()
    return sent


async def test_a_receiver_outlives_clients_that_give_up_mid_answer(dcs_config: DCSConfig, tmp_path: Path) -> None:
    with sync_stack(dcs_config, tmp_path, receivers=1) as stack:
        receiver = stack.receivers[0]
        sent = await abandon_requests(receiver, ABANDONED_REQUESTS)
        status = exit_status(receiver)
        if status != "alive":
            receiver.proc = None  # nothing left to stop
        assert status == "alive", f"receiver {status} after {sent} abandoned requests; log: {receiver.log_tail()}"
        assert httpx.get(f"{receiver.url}/health", timeout=30).status_code == 200
        # a session the abandoned calls left open is closed by the next updater (as the trainer does)
        httpx.post(f"{receiver.url}/end_weight_update", json={}, headers=auth_headers(stack.config.token()))
        tensor = join_and_push(receiver, stack.config, "after-abandoned-calls", version=1)
        digest = receiver.digest()
        assert digest.weight_version == 1 and digest.tensors == {"w": tensor_sha256(tensor)}


async def test_sigterm_stops_a_receiver_cleanly_after_it_left_its_group(dcs_config: DCSConfig, tmp_path: Path) -> None:
    with sync_stack(dcs_config, tmp_path, receivers=1) as stack:
        receiver = stack.receivers.pop()
        join_and_push(receiver, stack.config, "before-sigterm", version=1)
        assert receiver.proc is not None
        receiver.proc.send_signal(signal.SIGTERM)
        code = receiver.proc.wait(30)
        log = receiver.log_tail(100_000)
        receiver.proc = None
        assert code == 0, f"receiver {'killed by signal ' + str(-code) if code < 0 else f'exited {code}'}: {log}"
        assert "stopped: unregistered, groups left" in log, log
        assert 0 not in alive_ranks(stack.url, "rollout", stack.config.token())
