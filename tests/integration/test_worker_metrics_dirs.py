"""Two stacks on one host: each `dcs worker`'s /metrics counts only its own work, and its Prometheus directory
goes away with it (workers/prometheus.py).

Both workers run as a user runs them, with no PROMETHEUS_MULTIPROC_DIR set, the same namespace and the same host
name, each on its own Redis; only TMPDIR points at the test's directory, so the default location is private to
the test.
"""

from __future__ import annotations

import os
import signal
import urllib.request
from pathlib import Path

import pytest

from dcs_tasks import Checkpointer
from dcs_tasks.config import DCSConfig
from tests.checkpoint_support import ckpt_config, training_state, wait_until
from tests.helpers.ports import free_port
from tests.helpers.procs import WorkerProcess
from tests.helpers.redis_server import RedisServer

pytestmark = pytest.mark.integration


def _count(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def _prometheus_dirs(tmp: Path) -> list[Path]:
    return sorted(tmp.glob("dcs-prometheus-*"))


def _stack(base: DCSConfig, tmp_path: Path, name: str, redis_url: str) -> tuple[DCSConfig, WorkerProcess]:
    config = ckpt_config(base, tmp_path, redis_url=redis_url, enable_metrics=True, metrics_port=free_port())
    env = {"TMPDIR": str(tmp_path / "tmp"), "PROMETHEUS_MULTIPROC_DIR": ""}
    return config, WorkerProcess(config, tmp_path / f"{name}.log", env=env)


def test_one_stacks_worker_metrics_never_show_another_stacks_saves(dcs_config: DCSConfig, tmp_path: Path) -> None:
    (tmp_path / "tmp").mkdir()
    other_redis = RedisServer(tmp_path / "redis-b", appendonly=False)
    other_redis.start()
    config_a, worker_a = _stack(dcs_config, tmp_path, "worker-a", dcs_config.redis.url)
    config_b, worker_b = _stack(dcs_config, tmp_path, "worker-b", other_redis.url)
    try:
        worker_b.start()
        worker_a.start()
        with Checkpointer("stack-a", config_a.model_copy(update={"enable_metrics": False})) as ckpt:
            ckpt.save(training_state(width=128), step=1).wait(60)
        port_a, port_b = config_a.metrics.port, config_b.metrics.port
        wait_until(lambda: _count(port_a, "dcs_ckpt_commit_seconds_count") >= 1, 30, "stack A's commit metric")
        assert _count(port_b, "dcs_ckpt_persist_seconds_count") == 0  # stack B saved nothing
        assert _count(port_b, "dcs_ckpt_commit_seconds_count") == 0
        dirs = _prometheus_dirs(tmp_path / "tmp")
        assert len(dirs) == 2, dirs  # one per worker
        assert all((d.stat().st_mode & 0o777) == 0o700 for d in dirs)
        assert worker_a.proc is not None and worker_b.proc is not None
        pid_b = worker_b.proc.pid
        worker_a.terminate()  # a worker that exits removes its own directory
        assert [d for d in _prometheus_dirs(tmp_path / "tmp") if f"-{pid_b}-" not in d.name] == []
        os.killpg(pid_b, signal.SIGKILL)  # one that is killed leaves it for the next worker's start
        worker_b.proc.wait(10)
        worker_b.proc = None
        worker_a.start()
        assert worker_a.proc is not None
        left = _prometheus_dirs(tmp_path / "tmp")
        assert [d for d in left if f"-{worker_a.proc.pid}-" not in d.name] == [], left
    finally:
        worker_a.discard()
        worker_b.discard()
        other_redis.stop()
