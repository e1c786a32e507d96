"""Schemathesis fuzzes a real `dcs coordinator` (uvicorn, real redis-server, token configured) from its own
OpenAPI schema: no 5xx, every status documented, every body and content type as documented."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from pydantic import SecretStr

from dcs_tasks.config import DCSConfig
from tests.helpers.procs import CoordinatorProcess

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TOKEN = "schemathesis-token"
CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"
# The schema allows 300 s long-polls; a fuzz run must not wait that long per request. At a 1 s bound the long-polls
# took half the time of all requests (63 of 800 cases: 2.9 of 5.9 s).
LONG_POLL_BOUND_S = 0.1


def _schema_for_fuzzing(url: str) -> dict[str, object]:
    """The served schema, with the long-poll's upper bound lowered so every request answers quickly."""
    schema = httpx.get(f"{url}/openapi.json", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10).json()
    for param in schema["paths"]["/recv_weight_meta"]["get"]["parameters"]:
        if param["name"] == "wait_timeout_s":
            param["schema"]["maximum"] = LONG_POLL_BOUND_S
    return dict(schema)


def test_schemathesis_finds_no_nonconformance(dcs_config: DCSConfig, tmp_path: Path) -> None:
    config = dcs_config.model_copy(update={"auth_token": SecretStr(TOKEN)})
    coordinator = CoordinatorProcess(config, tmp_path / "coordinator.log").start()
    try:
        schema_path = tmp_path / "openapi.json"
        schema_path.write_text(json.dumps(_schema_for_fuzzing(coordinator.url)))
        # one worker: with two threads, hypothesis's concurrent ast.parse hits CPython 3.11's AST
        # recursion-depth bug (gh-106905: "SystemError: AST constructor recursion depth mismatch")
        cmd = [
            *(sys.executable, "-m", "schemathesis.cli", "run", str(schema_path)),
            *("--url", coordinator.url, "--header", f"Authorization: Bearer {TOKEN}"),
            *("--checks", CHECKS, "--max-examples", "8", "--seed", "7", "--workers", "1"),
            *("--phases", "coverage,fuzzing", "--no-shrink", "--request-timeout", "10"),
            *("--report", "junit", "--report-dir", str(tmp_path / "report"), "--warnings", "off"),
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False, cwd=tmp_path)
    finally:
        coordinator.stop()
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:] + coordinator.log_tail()
    assert " passed" in done.stdout and "failed" not in done.stdout.split("SUMMARY")[-1]
