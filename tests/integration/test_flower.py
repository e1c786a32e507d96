"""Celery's own CLI and Flower on the DCS broker: `celery -A workers.celery ...` against a real `dcs worker`.

Flower is started with the Procfile's own `flower:` line, so the test covers how it is deployed: bound to
127.0.0.1, its API open there unless `DCS_FLOWER_BASIC_AUTH` or `DCS_AUTH_TOKEN` is set.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from dcs_tasks import Checkpointer
from dcs_tasks.celery_app import CONTROL_QUEUE, TaskName, make_celery
from dcs_tasks.config import DCSConfig
from tests.checkpoint_support import ckpt_config, start_worker, training_state
from tests.helpers.ports import free_port, wait_for_port
from tests.helpers.procs import REPO, WorkerProcess, child_env
from tests.helpers.redis_server import RedisServer

pytestmark = [pytest.mark.integration, pytest.mark.own_redis]  # the Procfile lines use database 0

CLI_TIMEOUT = 120.0
FLOWER_TIMEOUT = 90.0


def celery_cli(config: DCSConfig, *args: str, timeout: float = CLI_TIMEOUT) -> subprocess.CompletedProcess[str]:
    """`celery -A workers.celery ARGS` in a fresh process that knows the deployment only from DCS_* variables."""
    cmd = [sys.executable, "-m", "celery", "-A", "workers.celery", *args]
    return subprocess.run(cmd, env=child_env(config), cwd=REPO, capture_output=True, text=True, timeout=timeout)


def procfile_line(name: str) -> str:
    for line in (REPO / "Procfile").read_text().splitlines():
        if line.startswith(f"{name}:"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"no {name}: line in the Procfile")


class Flower:
    """The Procfile's `flower:` line, run by sh as honcho runs it, on the test's Redis and a free port."""

    def __init__(self, redis_server: RedisServer, log_path: Path, extra_env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DCS_", "FLOWER_"))}
        env.update(
            PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
            PYTHONPATH=str(REPO),
            DCS_REDIS_PORT=str(redis_server.port),
            DCS_FLOWER_PORT=str(self.port),
        )
        env.update(extra_env or {})
        self.log_path = log_path
        with log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                ["sh", "-c", procfile_line("flower")],
                env=env,
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            wait_for_port(self.port, FLOWER_TIMEOUT)
        except TimeoutError:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def wait_for_events(self, worker: str, timeout: float = FLOWER_TIMEOUT) -> None:
        """Until Flower has an event of `worker` (its heartbeats): the event receiver is live, no task is missed."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            metrics = httpx.get(f"{self.url}/metrics", timeout=30).text
            if f'flower_worker_online{{worker="{worker}"}} 1.0' in metrics:
                return
            time.sleep(0.5)
        raise AssertionError(f"Flower received no worker event within {timeout}s; log: {self.log()}")


@pytest.fixture
def flower(redis_server: RedisServer, tmp_path: Path) -> Iterator[Flower]:
    proc = Flower(redis_server, tmp_path / "flower.log")
    yield proc
    proc.stop()


def test_celery_inspect_ping_answers_from_a_real_dcs_worker(dcs_config: DCSConfig, worker: WorkerProcess) -> None:
    # named: the reply of that one worker ends the wait (unnamed, `inspect` waits out its whole --timeout for
    # whoever else might answer)
    worker_name = f"dcs@{dcs_config.host_name}"
    result = celery_cli(dcs_config, "inspect", "ping", "--timeout=20", f"--destination={worker_name}", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    replies = json.loads(result.stdout.strip().splitlines()[-1])
    assert replies == {worker_name: {"ok": "pong"}}


def test_a_plain_celery_worker_of_this_app_is_refused_before_it_takes_a_task(dcs_config: DCSConfig) -> None:
    client = make_celery(dcs_config)
    client.send_task(TaskName.PING.value, queue=CONTROL_QUEUE)
    queue = client.connection_for_write().default_channel.client
    assert queue.llen(CONTROL_QUEUE) == 1

    result = celery_cli(dcs_config, "worker", "--pool=solo", "--loglevel=INFO")

    assert result.returncode != 0
    assert "dcs worker" in result.stderr
    assert queue.llen(CONTROL_QUEUE) == 1  # still queued for a real `dcs worker`


def test_flower_api_lists_the_persist_and_commit_tasks_of_a_real_save(
    dcs_config: DCSConfig, tmp_path: Path, flower: Flower
) -> None:
    config = ckpt_config(dcs_config, tmp_path)
    worker = start_worker(config, tmp_path)
    try:
        flower.wait_for_events(f"dcs@{config.host_name}")
        with Checkpointer("flowerrun", config) as ckpt:
            ckpt.save(training_state(), step=3).wait(timeout=60)
        wanted = {TaskName.PERSIST.value, TaskName.COMMIT.value}
        deadline = time.monotonic() + FLOWER_TIMEOUT
        done: set[str] = set()
        while time.monotonic() < deadline and not wanted <= done:
            answer = httpx.get(f"{flower.url}/api/tasks", timeout=30)
            assert answer.status_code == 200, answer.text  # no credentials: open on loopback
            done = {t["name"] for t in answer.json().values() if t["state"] == "SUCCESS"}
            time.sleep(0.5)
        assert wanted <= done, f"Flower saw {done}; log: {flower.log()}"
    finally:
        worker.discard()


@pytest.mark.parametrize(
    ("env", "user", "password"),
    [
        ({"DCS_FLOWER_BASIC_AUTH": "ops:s3cret-pass", "DCS_AUTH_TOKEN": "other-token"}, "ops", "s3cret-pass"),
        ({"DCS_AUTH_TOKEN": "t0ken-of-the-fleet"}, "dcs", "t0ken-of-the-fleet"),
    ],
    ids=["DCS_FLOWER_BASIC_AUTH", "DCS_AUTH_TOKEN"],
)
def test_flower_requires_basic_auth_when_a_credential_is_set(
    redis_server: RedisServer, tmp_path: Path, env: dict[str, str], user: str, password: str
) -> None:
    flower = Flower(redis_server, tmp_path / "flower-auth.log", env)
    try:
        assert httpx.get(f"{flower.url}/api/tasks", timeout=30).status_code == 401
        wrong = httpx.get(f"{flower.url}/api/tasks", auth=(user, "nope"), timeout=30)
        assert wrong.status_code == 401
        right = httpx.get(f"{flower.url}/api/tasks", auth=(user, password), timeout=30)
        assert right.status_code == 200 and right.json() == {}
        assert httpx.get(f"{flower.url}/metrics", timeout=30).status_code == 200  # Prometheus scrapes it bare
        assert httpx.get(f"{flower.url}/healthcheck", timeout=30).text == "OK"
    finally:
        flower.stop()
    assert password not in flower.log()


def readme_flower_command() -> str:
    """The README's command that starts Flower: a line of a code block, else an inline `...` span."""
    text = (REPO / "README.md").read_text()
    in_block = False
    for line in text.splitlines():
        if line.startswith("```"):
            in_block = not in_block
        elif in_block and "workers.celery flower" in line and not line.lstrip().startswith("#"):
            return line.strip()
    found = re.search(r"`([^`]*workers\.celery flower[^`]*)`", text)
    assert found is not None, "the README names no command that starts Flower"
    return found.group(1)


def test_the_readmes_flower_command_asks_for_credentials_on_its_ui_and_api(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """A user who copies the README's Flower command gets a UI and an API behind the fleet's token, and no Flower at
    all without a token (not a UI open to every local user beside an API that only answers 401)."""
    port = free_port()
    command = re.sub(r"--port[= ]\d+", f"--port={port}", readme_flower_command())
    token = "t0ken-of-the-readme"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DCS_", "FLOWER_"))}
    env.update(
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        PYTHONPATH=str(REPO),
        DCS_REDIS_URL=redis_server.url,
        FLOWER_PORT=str(port),
    )
    log = (tmp_path / "readme-flower.log").open("wb")
    proc = subprocess.Popen(
        ["sh", "-c", command],
        env={**env, "DCS_AUTH_TOKEN": token},
        cwd=REPO,
        stdout=log,
        stderr=log,
        start_new_session=True,
    )
    try:
        wait_for_port(port, FLOWER_TIMEOUT)
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{url}/", timeout=30).status_code == 401  # the UI
        assert httpx.get(f"{url}/api/workers", timeout=30).status_code == 401
        assert httpx.get(f"{url}/", auth=("dcs", token), timeout=30).status_code == 200
        assert httpx.get(f"{url}/api/tasks", auth=("dcs", token), timeout=30).status_code == 200
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()
    assert token not in (tmp_path / "readme-flower.log").read_text(errors="replace")
    refused = subprocess.run(["sh", "-c", command], env=env, cwd=REPO, capture_output=True, text=True, timeout=30)
    assert refused.returncode != 0 and "DCS_AUTH_TOKEN" in refused.stderr  # no token: no Flower
