"""An invalid DCS_* setting ends any `dcs` command with one line per setting and exit 2, never a traceback
that echoes the rejected value (a Redis URL or a token may carry a secret)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    ("command", "env"),
    [
        (["worker"], {"DCS_REDIS_URL": "sentinel://:hunter2@h1:26379"}),
        (["coordinator"], {"DCS_REDIS_URL": "redis://:hunter2@h1:6379/0", "DCS_HEARTBEAT_INTERVAL_SECONDS": "x"}),
        (["config"], {"DCS_REDIS_URL": "redis://:hunter2@h1:6379/0", "DCS_COMM_MAX_PORT": "not-a-port"}),
    ],
)
def test_invalid_settings_are_one_line_each_and_secret_free(command: list[str], env: dict[str, str]) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "dcs_tasks.cli.main", *command],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output
    assert "invalid settings" in output
    assert "Traceback" not in output
    assert "hunter2" not in output
    bad = [k for k in env if k != "DCS_REDIS_URL"] or ["DCS_REDIS_URL"]
    assert bad[0].removeprefix("DCS_").lower() in output
