"""The small /metrics server trainers use (dcs_tasks.metrics.serve_metrics), over real HTTP."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest

from dcs_tasks.metrics import get_metrics, serve_metrics


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
