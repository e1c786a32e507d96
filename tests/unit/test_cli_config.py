"""`dcs config` shows effective settings from the environment, masks secrets, and rejects bad values."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers.procs import REPO


def dcs(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), **env}
    return subprocess.run(
        [sys.executable, "-m", "dcs_tasks.cli.main", *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=60,
        check=False,
    )


def test_effective_values_and_masked_secret() -> None:
    done = dcs("config", DCS_KEEP_LAST="3", DCS_AUTH_TOKEN="hunter2")
    assert done.returncode == 0, done.stderr
    lines = dict(line.split(None, 1) for line in done.stdout.splitlines())
    assert lines["DCS_KEEP_LAST"].startswith("3")
    assert lines["DCS_AUTH_TOKEN"].startswith("***")
    assert "hunter2" not in done.stdout


def test_bad_value_is_named_and_exit_code_is_2() -> None:
    done = dcs("config", DCS_HEARTBEAT_TIMEOUT_SECONDS="1")
    assert done.returncode == 2
    assert "heartbeat_timeout_seconds must be larger than heartbeat_interval_seconds" in done.stderr


def test_markdown_reference_lists_every_setting() -> None:
    done = dcs("config", "--markdown")
    assert done.returncode == 0
    assert "`DCS_REDIS_URL`" in done.stdout and "`DCS_STAGING_BUFFERS`" in done.stdout


def test_configuration_reference_is_current() -> None:
    """docs/configuration.md is the output of `dcs config --markdown`; regenerate it when a setting changes."""
    done = dcs("config", "--markdown")
    assert done.stdout in (REPO / "docs" / "configuration.md").read_text()
