"""The small /metrics server trainers use (dcs_tasks.metrics.serve_metrics), over real HTTP."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from dcs_tasks.metrics import get_metrics, serve_metrics

ROOT = Path(__file__).resolve().parents[2]


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""


def test_it_serves_this_process_metrics_after_refreshing_them() -> None:
    calls: list[int] = []

    def refresh() -> None:
        calls.append(1)
        get_metrics().record_error("metrics-server-test")  # its own label: nothing else in the process moves

    server = serve_metrics("127.0.0.1", 0, before=refresh)
    try:
        status, text = get(server.port, "/metrics")
        assert status == 200 and 'dcs_errors_total{error_type="metrics-server-test"} 1.0' in text and calls == [1]
        assert get(server.port, "/other")[0] == 404 and calls == [1]  # only /metrics, and only it refreshes
    finally:
        server.close()


def test_a_failing_refresh_still_answers(caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> None:
        raise RuntimeError("redis is down")

    server = serve_metrics("127.0.0.1", 0, before=broken)
    try:
        status, text = get(server.port, "/metrics")
        assert status == 200 and "# TYPE dcs_pending_operations gauge" in text
        assert "metrics refresh before a scrape failed" in caplog.text
    finally:
        server.close()


_MULTIPROCESS_SERVER = """
import subprocess, sys
from dcs_tasks.metrics import get_metrics, serve_metrics
other = "from dcs_tasks.metrics import get_metrics; get_metrics().record_error('from-another-process')"
subprocess.run([sys.executable, "-c", other], check=True)
get_metrics().record_error('from-the-server-process')
server = serve_metrics("127.0.0.1", 0)
print(server.port, flush=True)
sys.stdin.read()
"""


def test_in_multiprocess_mode_it_serves_the_samples_of_every_process(tmp_path: Path) -> None:
    """With PROMETHEUS_MULTIPROC_DIR set (as `dcs worker` and prefork trainers run), a scrape aggregates the
    samples every process of the directory wrote, an exited one's counters included."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    server = subprocess.Popen(
        [sys.executable, "-c", _MULTIPROCESS_SERVER], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        status, text = get(port, "/metrics")
        assert status == 200
        assert 'dcs_errors_total{error_type="from-another-process"} 1.0' in text
        assert 'dcs_errors_total{error_type="from-the-server-process"} 1.0' in text
    finally:
        server.kill()
        server.wait(10)
