"""MetricsCollector: the original design's metric names, values a user reads back, and prometheus multiprocess mode."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dcs_tasks.metrics import MetricsCollector, get_metrics

REPO = Path(__file__).resolve().parents[2]

SEED_NAMES = [
    "dcs_save_latency_seconds",
    "dcs_load_latency_seconds",
    "dcs_send_latency_seconds",
    "dcs_recv_latency_seconds",
    "dcs_bytes_sent_total",
    "dcs_bytes_received_total",
    "dcs_bytes_saved_total",
    "dcs_bytes_loaded_total",
    "dcs_save_operations_total",
    "dcs_errors_total",
    "dcs_memory_buffer_usage_bytes",
    "dcs_active_connections",
    "dcs_pending_operations",
]


def test_export_has_every_seed_metric() -> None:
    metrics = MetricsCollector()
    metrics.record_error("timeout")
    text = metrics.export_prometheus()
    for name in SEED_NAMES:
        assert f"# TYPE {name} " in text, name


def test_recorded_values_are_read_back() -> None:
    metrics = MetricsCollector()
    metrics.record_send(bytes_sent=1024 * 1024, duration=0.05)
    metrics.record_send(bytes_sent=1024, duration=0.15)
    metrics.record_save(bytes_saved=5 * 1024 * 1024, duration=1.2)
    metrics.record_error("timeout")
    metrics.record_error("timeout")
    metrics.pending_operations.inc(3)
    stats = metrics.get_all()
    assert stats["counters"]["bytes_sent"] == 1024 * 1024 + 1024
    assert stats["counters"]["send_operations"] == 2 and stats["counters"]["errors"] == 2
    assert stats["latency"]["send"]["avg"] == pytest.approx(0.1)
    assert stats["latency"]["save"]["buckets"]["2.5"] == 1 and stats["latency"]["save"]["buckets"]["1.0"] == 0
    assert stats["gauges"]["pending_operations"] == 3
    text = metrics.export_prometheus()
    assert 'dcs_errors_total{error_type="timeout"} 2.0' in text
    assert "dcs_bytes_saved_total 5.24288e+06" in text


def test_collectors_are_independent_and_global_is_shared() -> None:
    a, b = MetricsCollector(), MetricsCollector()
    a.record_load(bytes_loaded=10, duration=0.1)
    assert b.get_all()["counters"]["bytes_loaded"] == 0
    assert get_metrics() is get_metrics()


def test_negative_values_are_refused() -> None:
    with pytest.raises(ValueError, match="save"):
        MetricsCollector().record_save(bytes_saved=-1, duration=0.1)


CHILD = """
from dcs_tasks.metrics import get_metrics
m = get_metrics()
m.record_send(bytes_sent=100, duration=0.01)
m.memory_buffer_usage.set(7)
stats = m.get_all()  # this process's own values, also in multiprocess mode
assert stats["counters"]["bytes_sent"] == 100 and stats["gauges"]["memory_buffer_usage_bytes"] == 7, stats
assert stats["latency"]["send"]["count"] == 1, stats
"""


def test_multiprocess_mode_aggregates_every_process(tmp_path: Path) -> None:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PYTHONPATH": str(REPO)}
    for _ in range(2):
        subprocess.run([sys.executable, "-c", CHILD], env=env, check=True, timeout=60)
    export = "from dcs_tasks.metrics import get_metrics; print(get_metrics().export_prometheus())"
    out = subprocess.run(
        [sys.executable, "-c", export], env=env, check=True, timeout=60, capture_output=True, text=True
    )
    assert "dcs_bytes_sent_total 200.0" in out.stdout
    assert "dcs_send_latency_seconds_count 2.0" in out.stdout


PREPARED_LATE = """
import os, sys
import prometheus_client  # imported before the worker sets its directory, as in a process that embeds it
from dcs_tasks.config import DCSConfig
from workers.prometheus import prepare_multiprocess_dir
directory = prepare_multiprocess_dir(DCSConfig(enable_metrics=True))
from dcs_tasks.metrics import get_metrics
get_metrics().record_send(bytes_sent=100, duration=0.01)
print(directory, sorted(os.listdir(directory)))
"""


def test_a_worker_directory_set_after_prometheus_client_was_imported_still_gets_the_samples(tmp_path: Path) -> None:
    """prometheus_client picks its value store at import; `prepare_multiprocess_dir` makes it follow the directory
    it sets, so a process that imported prometheus_client first (one that embeds the worker, a test's preloaded
    fork) writes its samples there for the worker's scrape to aggregate."""
    env = {k: v for k, v in os.environ.items() if k not in ("PROMETHEUS_MULTIPROC_DIR", "prometheus_multiproc_dir")}
    env.update({"PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path)})
    out = subprocess.run(
        [sys.executable, "-c", PREPARED_LATE], env=env, check=True, timeout=60, capture_output=True, text=True
    )
    directory, files = out.stdout.split(" ", 1)
    assert directory.startswith(str(tmp_path)), out.stdout
    assert "counter_" in files and "histogram_" in files, out.stdout
