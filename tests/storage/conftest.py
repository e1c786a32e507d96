"""Fixtures of the S3 storage tests: a real S3 server (OpenStack Swift + s3api, tests/helpers/s3server.py).

`s3_server`: one server per pytest process, started at the first test that needs it (about 3 s). Tests share
it, so they must not stop, kill or restart it: a test that does asks for `own_s3_server` (a private server in
its tmp_path) instead, also for HTTPS (`tls`: boto3 sends uploads differently there). `s3_bucket`: a fresh
bucket of the owner on the shared server, per test.

Tests using any of them are marked `integration`. Skipped, with the reason, only where swift is not installed
(`make test` installs it: the `test` extras in pyproject.toml).
"""

from __future__ import annotations

import itertools
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.s3server import S3Server, swift_available

S3_FIXTURES = ("s3_server", "s3_bucket", "own_s3_server")
NOT_INSTALLED = "OpenStack Swift (pip `swift`, the S3 server of these tests) is not installed: pip install -e '.[test]'"
_bucket_numbers = itertools.count(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if any(name in getattr(item, "fixturenames", ()) for name in S3_FIXTURES):
            item.add_marker(pytest.mark.integration)


@dataclass(frozen=True)
class S3Bucket:
    """One test's bucket: where it is and the owner's credentials. `server` has the rest (the other user's
    credentials, quotas)."""

    endpoint_url: str
    access_key: str
    secret_key: str
    region: str
    bucket: str
    server: S3Server = field(repr=False)

    def url(self, prefix: str = "") -> str:
        return f"s3://{self.bucket}/{prefix.lstrip('/')}"

    def client(self, *, other_user: bool = False, **config: Any) -> Any:
        """A boto3 S3 client (path-style addressing) as the owner, or as the user with no rights on the bucket;
        `config`: more botocore Config arguments."""
        return s3_client(self.server, other_user=other_user, **config)

    def set_quota(self, quota_bytes: int | None) -> None:
        """Byte quota on the bucket and on its multipart parts (S3Server.set_bucket_quota)."""
        self.server.set_bucket_quota(self.bucket, quota_bytes)


def s3_client(server: S3Server, *, other_user: bool = False, **config: Any) -> Any:
    import boto3
    from botocore.config import Config

    s3_config = {"addressing_style": "path", **config.pop("s3", {})}
    return boto3.client(
        "s3",
        endpoint_url=server.endpoint_url,
        aws_access_key_id=server.other_access_key if other_user else server.access_key,
        aws_secret_access_key=server.other_secret_key if other_user else server.secret_key,
        region_name=server.region,
        verify=server.ca_bundle,
        config=Config(s3=s3_config, **config),
    )


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """The S3 server the tests of this pytest process share (do not stop, kill or restart it)."""
    if not swift_available():
        pytest.skip(NOT_INSTALLED)
    workdir = Path(tempfile.mkdtemp(prefix="dcs-s3-"))
    server = S3Server(workdir)
    try:
        server.start()
        yield server
    finally:
        # nothing on it is needed after the session: SIGKILL every server's process group (a graceful stop
        # waited up to 10 s on Swift's SIGTERM handling); tests that stop or restart a server use their own
        server.kill(everything=True)
        remove_in_background(workdir)


def remove_in_background(workdir: Path) -> None:
    """rm -rf `workdir` in a process of its own that pytest does not wait for: Swift keeps every object in
    directories of its own, and removing the data of a full run (thousands of objects) took 14 s at session end."""
    try:  # the shell returns at once; its rm, in the background, is left to finish on its own
        subprocess.run(
            ["sh", "-c", 'rm -rf -- "$1" &', "sh", str(workdir)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def own_s3_server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[S3Server]:
    """A private S3 server the test may stop, kill and restart; every process of it is gone afterwards.
    S3Server arguments by indirect parametrization: `@pytest.mark.parametrize("own_s3_server", [{"tls": True}],
    indirect=True)`."""
    if not swift_available():
        pytest.skip(NOT_INSTALLED)
    server = S3Server(tmp_path / "s3", **getattr(request, "param", {}))
    try:
        server.start()
        yield server
    finally:
        server.kill(everything=True)  # the test's own stop/restart calls stay graceful; afterwards nothing is kept


def new_bucket(server: S3Server, prefix: str, endpoint_url: str | None = None) -> S3Bucket:
    """A fresh bucket `<prefix>-<random>` on `server` with its owner's credentials (`endpoint_url`: another form of
    the server's URL, e.g. one carrying a user and password)."""
    name = f"{prefix}-{uuid.uuid4().hex[:12]}"
    s3_client(server).create_bucket(Bucket=name)
    return S3Bucket(
        endpoint_url=endpoint_url or server.endpoint_url,
        access_key=server.access_key,
        secret_key=server.secret_key,
        region=server.region,
        bucket=name,
        server=server,
    )


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> S3Bucket:
    if not s3_server.alive():
        raise RuntimeError(f"the shared S3 server is gone (a test stopped it?)\n{s3_server.log_tail()}")
    return new_bucket(s3_server, f"dcs-test-{next(_bucket_numbers)}")


@pytest.fixture
def own_bucket(own_s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Bucket:
    """A bucket on a private S3 server the test may stop and start, its owner's credentials in the AWS
    environment (`s3_support.use_bucket`)."""
    from tests.storage.s3_support import use_bucket

    return use_bucket(new_bucket(own_s3_server, "dcs-own"), monkeypatch)


@pytest.fixture
def aws_env(s3_bucket: S3Bucket, monkeypatch: pytest.MonkeyPatch) -> S3Bucket:
    """`s3_bucket` with the owner's credentials in the standard AWS environment (`s3_support.use_bucket`)."""
    from tests.storage.s3_support import use_bucket

    return use_bucket(s3_bucket, monkeypatch)
