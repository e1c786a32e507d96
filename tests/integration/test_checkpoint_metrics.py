"""Worker-side checkpoint metrics through prometheus multiprocess mode, scraped from the worker's exporter."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest

from dcs_tasks import Checkpointer
from dcs_tasks.config import DCSConfig
from tests.checkpoint_support import ckpt_config, training_state, wait_until
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
        worker.terminate()
