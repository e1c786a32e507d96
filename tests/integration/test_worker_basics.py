"""A real `dcs worker`: it starts, announces itself, runs a task, and refuses pickle."""

from __future__ import annotations

import time

import pytest

from dcs_tasks.celery_app import TaskName, make_celery, node_queue
from dcs_tasks.config import DCSConfig
from dcs_tasks.keys import Keys
from tests.helpers.procs import WorkerProcess
from tests.helpers.redis_server import RedisServer

pytestmark = pytest.mark.integration


def test_worker_runs_a_task_from_its_node_queue(dcs_config: DCSConfig, worker: WorkerProcess) -> None:
    app = make_celery(dcs_config)
    result = app.send_task(TaskName.PING.value, queue=node_queue(dcs_config.host_name))
    answer = result.get(timeout=30)
    assert answer["pid"] in worker.child_pids()


def test_presence_key_disappears_after_kill(
    dcs_config: DCSConfig, redis_server: RedisServer, worker: WorkerProcess
) -> None:
    key = Keys(dcs_config.redis.namespace).worker_presence(node_queue(dcs_config.host_name))
    client = redis_server.client()
    assert client.exists(key)
    worker.kill()
    deadline = time.monotonic() + 10
    while client.exists(key) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not client.exists(key)


def test_pickle_message_is_rejected(dcs_config: DCSConfig, worker: WorkerProcess) -> None:
    app = make_celery(dcs_config)
    app.conf.accept_content = ["json", "pickle"]
    result = app.send_task(TaskName.PING.value, queue=node_queue(dcs_config.host_name), serializer="pickle")
    ok = app.send_task(TaskName.PING.value, queue=node_queue(dcs_config.host_name))
    assert ok.get(timeout=30)["pid"] > 0
    assert result.state == "PENDING"  # the worker refused it: never started, never stored
    assert "ContentDisallowed" in worker.log_tail(20000) or "disallowed" in worker.log_tail(20000).lower()
