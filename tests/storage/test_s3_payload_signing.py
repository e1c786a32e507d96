"""`s3_payload_signing` reaches the requests DCS sends to the real S3 server (Swift + s3api, which checks a
signed body's SHA-256 itself): each UploadPart's `x-amz-content-sha256` as it leaves botocore (its `before-send`
event sees the request after signing), and the object the server stored."""

from __future__ import annotations

import hashlib
import os
from typing import Any

import pytest
import xxhash

from dcs_tasks.storage.s3 import S3Settings, S3Store, payload_unsigned_by_default
from dcs_tasks.storage_url import ObjectURL
from tests.storage.conftest import S3Bucket

MiB = 1024 * 1024
UNSIGNED = "UNSIGNED-PAYLOAD"


def _upload_and_record(bucket: S3Bucket, signing: str) -> tuple[bytes, list[tuple[int, str]]]:
    """Upload 11 MiB in 5 MiB parts (three) through DCS's S3 store with `signing`; the bytes, and (part number,
    x-amz-content-sha256) of every UploadPart sent. The object must read back as it was sent."""
    settings = S3Settings(
        endpoint_url=bucket.endpoint_url,
        region=bucket.region,
        addressing_style="path",
        part_bytes=5 * MiB,
        concurrency=3,
        payload_signing=signing,
    )
    store = S3Store(ObjectURL.parse(bucket.url("signing")), settings)
    sent: list[tuple[int, str]] = []

    def record(request: Any, **_: Any) -> None:
        number = int(request.url.split("partNumber=")[1].split("&")[0])
        sent.append((number, request.headers["X-Amz-Content-SHA256"].decode()))

    events = store.client.meta.events
    events.register("before-send.s3.UploadPart", record)
    data = os.urandom(11 * MiB)
    key = f"signing/{signing}"
    try:
        store.upload(key, memoryview(data), xxhash.xxh3_128())
    finally:
        events.unregister("before-send.s3.UploadPart", record)
    assert bucket.client().get_object(Bucket=bucket.bucket, Key=key)["Body"].read() == data
    return data, sorted(sent)


def _part_digests(data: bytes) -> list[tuple[int, str]]:
    return [
        (i // (5 * MiB) + 1, hashlib.sha256(data[i : i + 5 * MiB]).hexdigest()) for i in range(0, len(data), 5 * MiB)
    ]


@pytest.mark.parametrize("signing", ["on", "auto"])
def test_signed_parts_over_http_carry_their_sha256(aws_env: S3Bucket, signing: str) -> None:
    """`on`, and `auto` over plain http (where the signature is the body's only protection): every part's
    signature covers its SHA-256, which the server checked before storing it."""
    assert aws_env.endpoint_url.startswith("http://")
    data, sent = _upload_and_record(aws_env, signing)
    assert sent == _part_digests(data)


def test_off_sends_unsigned_payload_over_http(aws_env: S3Bucket) -> None:
    """`off`: every part says UNSIGNED-PAYLOAD (headers still signed: the server accepted them), even over http."""
    _, sent = _upload_and_record(aws_env, "off")
    assert sent == [(1, UNSIGNED), (2, UNSIGNED), (3, UNSIGNED)]


@pytest.mark.parametrize("own_s3_server", [{"tls": True}], indirect=True)
def test_auto_is_unsigned_over_https_and_on_still_signs(own_bucket: S3Bucket) -> None:
    """Over https `auto` sends UNSIGNED-PAYLOAD (TLS carries the body's integrity), as AWS's SDKs do there;
    `on` signs every part's SHA-256 over https too."""
    assert own_bucket.endpoint_url.startswith("https://")
    _, sent = _upload_and_record(own_bucket, "auto")
    assert sent == [(1, UNSIGNED), (2, UNSIGNED), (3, UNSIGNED)]
    data, sent = _upload_and_record(own_bucket, "on")
    assert sent == _part_digests(data)


def test_auto_decides_by_the_scheme_of_the_endpoint() -> None:
    assert payload_unsigned_by_default("https://s3.us-east-1.amazonaws.com")
    assert payload_unsigned_by_default("HTTPS://minio.internal:9000")
    assert not payload_unsigned_by_default("http://127.0.0.1:9000")
