"""What `CoordinatorAPI` retries while the coordinator is unavailable, for how long, and the idempotent append
that makes retrying `send_weight_meta` safe (tests/multihost/test_coordinator_replicas.py kills a replica
behind HAProxy)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from dcs_tasks.config import DCSConfig, RoleInfo
from dcs_tasks.coordinator_api import CoordinatorAPI
from dcs_tasks.errors import CoordinatorUnavailable
from dcs_tasks.models import WeightMeta
from tests.helpers.ports import free_port
from tests.helpers.procs import CoordinatorProcess
from tests.integration.coordinator_support import InProcessCoordinator, in_process_coordinator

pytestmark = [pytest.mark.integration]

ENTRY = WeightMeta(names=["w"], dtypes=["float32"], shapes=[[2]], group_name="g")


@pytest.fixture
async def coord(dcs_config: DCSConfig) -> AsyncIterator[InProcessCoordinator]:
    async with in_process_coordinator(dcs_config) as c:
        yield c


async def test_an_append_repeated_with_its_idempotency_key_is_stored_once(coord: InProcessCoordinator) -> None:
    body = ENTRY.model_dump_json()
    headers = {"Idempotency-Key": "a1b2c3d4e5f6", "Content-Type": "application/json"}
    first = await coord.http.post("/send_weight_meta", content=body, headers=headers)
    again = await coord.http.post("/send_weight_meta", content=body, headers=headers)  # its first answer "lost"
    other = await coord.http.post("/send_weight_meta", content=body, headers={**headers, "Idempotency-Key": "x" * 8})
    assert first.status_code == again.status_code == other.status_code == 200
    assert first.json()["message"] == again.json()["message"] == "appended entry 0"
    assert other.json()["message"] == "appended entry 1"
    assert len((await coord.api.recv_weight_meta(0)).entries) == 2


@pytest.mark.parametrize("key", ["short", "has space in it", "x" * 129])
async def test_a_malformed_idempotency_key_is_422_naming_it(coord: InProcessCoordinator, key: str) -> None:
    headers = {"Idempotency-Key": key, "Content-Type": "application/json"}
    response = await coord.http.post("/send_weight_meta", content=ENTRY.model_dump_json(), headers=headers)
    assert response.status_code == 422 and "Idempotency-Key" in response.text
    assert (await coord.api.recv_weight_meta(0)).entries == []


async def test_repeatable_calls_wait_for_a_coordinator_that_comes_up(dcs_config: DCSConfig, tmp_path: Path) -> None:
    proc = CoordinatorProcess(dcs_config, tmp_path / "coordinator-late.log")
    async with CoordinatorAPI(proc.url, timeout=5, retry_for_s=60) as api:
        starting = asyncio.create_task(asyncio.to_thread(proc.start))
        try:
            registered = await api.register(RoleInfo(role_name="actor", port=4000))  # a port: repeatable
            assert registered.rank == 0
            assert (await api.heartbeat("actor", 0, ip="127.0.0.1", port=4000)).timestamp > 0
            assert (await api.send_weight_meta(ENTRY)).message == "appended entry 0"
            assert api.retries >= 1  # the coordinator was not up at the first attempt
        finally:
            await starting
            proc.stop()


async def test_calls_a_repeat_could_change_fail_at_once(dcs_config: DCSConfig) -> None:
    async with CoordinatorAPI(f"http://127.0.0.1:{free_port()}", timeout=2, retry_for_s=60) as api:
        began = time.monotonic()
        with pytest.raises(CoordinatorUnavailable, match="unreachable for POST /register"):
            await api.register(RoleInfo(role_name="actor"))  # no rank, no port: a repeat would take a new rank
        with pytest.raises(CoordinatorUnavailable, match="unreachable for DELETE /unregister"):
            await api.unregister("actor", 0)
        with pytest.raises(CoordinatorUnavailable, match="unreachable for POST /clear_weight_meta"):
            await api.clear_weight_meta()
        with pytest.raises(CoordinatorUnavailable, match="unreachable for GET /healthz"):
            await api.healthz()  # a probe answers for now
        assert api.retries == 0 and time.monotonic() - began < 5


async def test_retries_end_after_retry_for_s(dcs_config: DCSConfig) -> None:
    async with CoordinatorAPI(f"http://127.0.0.1:{free_port()}", timeout=2, retry_for_s=1.0) as api:
        began = time.monotonic()
        with pytest.raises(CoordinatorUnavailable, match="unreachable for GET /heartbeat"):
            await api.heartbeat("actor", 0)
        waited = time.monotonic() - began
    assert 1.0 <= waited < 3.0 and api.retries >= 2
