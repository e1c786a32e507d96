"""Worker-side checkpoint metrics through prometheus multiprocess mode, scraped from the worker's exporter."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest

from dcs_tasks import Checkpointer
from dcs_tasks.config import DCSConfig
from tests.checkpoint_support import ckpt_config, start_worker, training_state, wait_until
from tests.helpers.ports import free_port
from tests.helpers.procs import WorkerProcess

pytestmark = pytest.mark.integration


def _sample(text: str, name: str) -> float:
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith(name + " ") or line.startswith(name + "{")
    )


def test_persist_and_commit_latency_are_exported_by_the_worker(dcs_config: DCSConfig, tmp_path: Path) -> None:
    port = free_port()
    config = ckpt_config(dcs_config, tmp_path, enable_metrics=True, metrics_port=port, file_shard_bytes=1 << 20)
    prom_dir = tmp_path / "prom"
    prom_dir.mkdir()
    (prom_dir / "stale_counter_1.db").write_bytes(b"junk from an earlier run")
    worker = WorkerProcess(config, tmp_path / "worker.log", env={"PROMETHEUS_MULTIPROC_DIR": str(prom_dir)}).start()
    try:
        assert not (prom_dir / "stale_counter_1.db").exists()  # wiped at start
        with Checkpointer("metrics", config.model_copy(update={"enable_metrics": False})) as ckpt:
            info = ckpt.save(training_state(width=512), step=1).wait(60)

        def scrape() -> str:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
                return str(answer.read().decode())

        wait_until(lambda: _sample(scrape(), "dcs_ckpt_commit_seconds_count") >= 1, 30, "the commit metric")
        text = scrape()
        assert _sample(text, "dcs_ckpt_persist_seconds_count") == info.files  # one per file, every child summed
    finally:
        worker.discard()


def test_trainer_gauges_follow_staging_memory_and_saves_in_flight(dcs_config: DCSConfig, tmp_path: Path) -> None:
    """The original design's dcs_memory_buffer_usage_bytes and dcs_pending_operations move with the trainer's staging
    pool and its saves, and return to where they were once the checkpointer closes."""
    from dcs_tasks.metrics import get_metrics

    registry = get_metrics().registry

    def gauge(name: str) -> float:
        return registry.get_sample_value(name) or 0.0

    config = ckpt_config(dcs_config, tmp_path)
    memory0, pending0 = gauge("dcs_memory_buffer_usage_bytes"), gauge("dcs_pending_operations")
    worker = start_worker(config, tmp_path)
    try:
        ckpt = Checkpointer("gauges", config)
        state = training_state(width=256)
        ckpt.reserve(state)
        reserved = gauge("dcs_memory_buffer_usage_bytes") - memory0
        assert reserved >= sum(t.numel() * t.element_size() for t in state["model"].values())
        pending = ckpt.save(state, step=1)
        assert gauge("dcs_pending_operations") - pending0 == 1
        pending.wait(60)
        ckpt.close()
        assert gauge("dcs_memory_buffer_usage_bytes") == memory0 and gauge("dcs_pending_operations") == pending0
    finally:
        worker.discard()
