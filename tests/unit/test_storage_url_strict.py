"""Storage roots are parsed strictly: anything that looks like a URL and is not exactly `s3://bucket[/prefix]` or
`file:///path` is refused with `InvalidStorageURL` (as met: `DCS_CHECKPOINT_DIR=s3:/bucket/prefix` and
`s3//bucket` became local folders and every save "succeeded" there). Read from the environment as a trainer or
`dcs worker` reads it, and by `dcs config`, which exits 2 naming the setting."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dcs_tasks import errors
from dcs_tasks.config import DCSConfig
from dcs_tasks.storage_url import ObjectURL, parse_root

REPO = Path(__file__).resolve().parents[2]

MISTYPED = [
    "s3:/bucket/prefix",
    "s3//bucket",
    "s3//bucket/prefix",
    "s3:bucket",
    "s3:bucket/prefix",
    "S3://bucket/prefix",
    "S3:/bucket",
    "s3:///bucket",
    "s3://bucket//prefix",
    "file:/data/ckpt",
    "File:///data/ckpt",
    "file://host/data",
    "gs://bucket/prefix",
    "https://bucket.s3.amazonaws.com/prefix",
    "gs//bucket",
]


@pytest.mark.parametrize("value", MISTYPED)
def test_a_mistyped_url_in_the_environment_is_refused_by_name(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DCS_CHECKPOINT_DIR", value)
    with pytest.raises(ValueError, match=r"s3://bucket/prefix|file:///|scheme") as caught:
        DCSConfig()
    assert "checkpoint_dir" in str(caught.value)
    with pytest.raises(errors.ConfigError) as direct:
        parse_root(value)
    assert type(direct.value).__name__ == "InvalidStorageURL", repr(direct.value)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("s3://bucket/prefix", ObjectURL("bucket", "prefix")),
        ("s3://bucket/prefix/", ObjectURL("bucket", "prefix")),
        ("s3://bucket", ObjectURL("bucket", "")),
        ("file:///data/ckpt", Path("/data/ckpt")),
        ("/data/ckpt", Path("/data/ckpt")),
        ("relative/ckpt", Path("relative/ckpt")),
        ("./s3:bucket", Path("s3:bucket")),  # a local folder whose name holds a colon, written as a path
        ("/data/run:1", Path("/data/run:1")),
    ],
)
def test_exact_urls_and_plain_paths_are_taken(value: str, expected: object) -> None:
    assert parse_root(value) == expected
    assert DCSConfig(checkpoint_dir=value).checkpoint.dir == expected


def test_dcs_config_exits_2_naming_the_setting_and_the_right_form() -> None:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-m", "dcs_tasks.cli.main", "config"]
    for name in ("DCS_CHECKPOINT_DIR", "DCS_REPLICA_DIR"):
        done = subprocess.run(
            argv, env={**env, name: "s3:/bucket/prefix"}, capture_output=True, text=True, timeout=60, cwd=REPO
        )
        assert done.returncode == 2, done.stdout + done.stderr
        assert name.removeprefix("DCS_").lower() in done.stderr and "s3://bucket/prefix" in done.stderr, done.stderr
