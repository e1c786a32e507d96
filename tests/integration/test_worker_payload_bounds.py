"""Task payloads are bounded by what DCS itself sends (issue 20, finding 8): two `join_engine` payloads with
`timeout_seconds=1e9` held both slots of a real `dcs worker` (a ping on the node queue waited behind them).
Now such a payload is refused at once (`InvalidTaskPayload`, never retried), and a valid one asking for more
than the worker's own `group_init_timeout_seconds` waits no longer than that."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dcs_tasks.celery_app import TaskName, make_celery, node_queue
from dcs_tasks.config import DCSConfig
from dcs_tasks.sync.wire import EngineEndpoint, InitWeightsUpdateGroupRequest, JoinRequest
from tests.checkpoint_support import start_worker
from tests.helpers.procs import WorkerProcess

pytestmark = pytest.mark.integration

OWN_TIMEOUT = 1.0  # the worker's group_init_timeout_seconds: its joins wait at most this + 5 s for an answer


@pytest.fixture
def silent_engine() -> Iterator[int]:
    """A port that takes connections (the kernel's backlog) and never answers."""
    with socket.create_server(("127.0.0.1", 0), backlog=16) as server:
        yield server.getsockname()[1]


def _join(port: int, timeout_seconds: Any) -> dict[str, Any]:
    body = InitWeightsUpdateGroupRequest(master_address="127.0.0.1", master_port=1, rank_offset=1, world_size=2)
    payload = JoinRequest(engine=EngineEndpoint(rank=0, ip="127.0.0.1", port=port), body=body, timeout_seconds=1.0)
    return {**payload.model_dump(mode="json"), "timeout_seconds": timeout_seconds}


def test_join_payloads_cannot_hold_the_worker(dcs_config: DCSConfig, tmp_path: Path, silent_engine: int) -> None:
    config = dcs_config.model_copy(update={"group_init_timeout_seconds": OWN_TIMEOUT})
    worker = start_worker(config, tmp_path, concurrency=2)
    app, queue = make_celery(config), node_queue(config.host_name)
    try:
        for hostile in (1e9, float("inf"), 3601):
            joins = [
                app.send_task(TaskName.JOIN_ENGINE.value, args=[_join(silent_engine, hostile)], queue=queue)
                for _ in range(2)
            ]
            for result in joins:
                with pytest.raises(Exception) as refused:
                    result.get(timeout=30)
                assert type(refused.value).__name__ == "InvalidTaskPayload", refused.value
                assert "timeout_seconds" in str(refused.value)
        started = time.monotonic()  # valid, but more than this worker would wait: capped at its own setting
        joins = [
            app.send_task(TaskName.JOIN_ENGINE.value, args=[_join(silent_engine, 3000.0)], queue=queue)
            for _ in range(2)
        ]
        ping = app.send_task(TaskName.PING.value, queue=queue)
        assert ping.get(timeout=30) is not None
        for result in joins:
            outcome = result.get(timeout=30)
            assert outcome["success"] is False and outcome["outcome"] == "timed_out", outcome
        assert time.monotonic() - started < OWN_TIMEOUT + 5 + 6
    finally:
        worker.discard()


def test_a_join_may_hold_a_worker_slot_for_minutes_at_most_unless_the_cap_is_raised(
    dcs_config: DCSConfig, tmp_path: Path
) -> None:
    """A join holds one of the worker's pool slots for up to its `group_init_timeout_seconds`: that setting is
    bounded by DCS_GROUP_INIT_TIMEOUT_MAX_SECONDS (default 300 s), so a worker started with 900 s refuses to
    start naming both settings (before, up to 3,600 s was taken: two joins held both slots for an hour). With
    the cap raised on purpose it starts and serves."""
    longer = {"DCS_GROUP_INIT_TIMEOUT_SECONDS": "900"}
    worker = WorkerProcess(dcs_config, tmp_path / "refused.log", concurrency=1, env=longer)
    try:
        with pytest.raises(RuntimeError, match="worker exited") as refused:
            worker.start(timeout=60)
    finally:
        worker.discard()
    assert "group_init_timeout_max_seconds" in str(refused.value), str(refused.value)[-2000:]
    assert "DCS_GROUP_INIT_TIMEOUT_MAX_SECONDS" in str(refused.value), str(refused.value)[-2000:]
    raised = {**longer, "DCS_GROUP_INIT_TIMEOUT_MAX_SECONDS": "900"}
    worker = WorkerProcess(dcs_config, tmp_path / "raised.log", concurrency=1, env=raised).start()
    try:
        ping = make_celery(dcs_config).send_task(TaskName.PING.value, queue=node_queue(dcs_config.host_name))
        assert ping.get(timeout=30) is not None
    finally:
        worker.discard()
