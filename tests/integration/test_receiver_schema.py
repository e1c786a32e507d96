"""Schemathesis against a real `dcs receiver` (DCS_AUTH_TOKEN set): whatever it is sent, it answers as its
OpenAPI schema says (documented status codes, content types and bodies), never with a 5xx, and it stays
healthy, holding no group, afterwards.

Fuzzed inits cannot make it join anything: the receiver is never rank 0 (rank_offset >= 1), so it only ever
dials out, nothing in the test listens as a master, and each dial is bounded by a 1 s group init timeout."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from pydantic import SecretStr

from dcs_tasks.config import DCSConfig
from tests.distributed.sync_stack import ReceiverProcess, auth_headers
from tests.helpers.procs import CoordinatorProcess

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TOKEN = "schema-fuzz-token-91c2"
CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"


def test_receiver_conforms_to_its_schema_under_fuzzing(dcs_config: DCSConfig, tmp_path: Path) -> None:
    update = {"auth_token": SecretStr(TOKEN), "group_init_timeout_seconds": 1.0, "comm_timeout_seconds": 2.0}
    config = dcs_config.model_copy(update=update)
    coordinator = CoordinatorProcess(config, tmp_path / "coordinator.log").start()
    config = config.model_copy(update={"coordinator_url": coordinator.url})
    receiver = ReceiverProcess(config, coordinator.url, 0, tmp_path / "receiver.log")
    try:
        receiver.start()
        command = [
            *(sys.executable, "-m", "schemathesis.cli", "run", f"{receiver.url}/openapi.json"),
            *("--header", f"Authorization: Bearer {TOKEN}", "--checks", CHECKS),
            *("--max-examples", "15", "--workers", "1", "--request-timeout", "20", "--max-time", "35"),
            *("--phases", "examples,coverage,fuzzing", "--suppress-health-check", "all", "--seed", "1"),
        ]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
        (tmp_path / "schemathesis.txt").write_text(done.stdout + done.stderr)
        assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:] + receiver.log_tail()
        headers = auth_headers(TOKEN)
        assert httpx.get(f"{receiver.url}/health", timeout=10).status_code == 200
        digest = httpx.get(f"{receiver.url}/weights_digest", headers=headers, timeout=10).json()
        assert digest == {"weight_version": 0, "tensors": {}}
    finally:
        receiver.stop()
        coordinator.stop()
