"""The pure parts of the S3 store (dcs_tasks/storage/s3.py, storage_url.py): botocore errors mapped to DCS's
(which are retried, what the message names), hostile keys refused, the part reader botocore rewinds on a retry.
No server: botocore's own exception classes, built as botocore builds them."""

from __future__ import annotations

import io

import pytest
from botocore import exceptions as bx

from dcs_tasks.errors import StorageAccessDenied, StorageError, StorageFull, StorageNotFound, StorageUnavailable
from dcs_tasks.storage.s3 import ObjectMissing, ViewReader, translate
from dcs_tasks.storage_url import MAX_KEY_BYTES, check_key
from workers.taskbase import RETRYABLE


def client_error(code: str, status: int, message: str = "", op: str = "PutObject") -> bx.ClientError:
    error = {"Code": code, "Message": message} if code else {}
    return bx.ClientError({"Error": error, "ResponseMetadata": {"HTTPStatusCode": status}}, op)


@pytest.mark.parametrize(
    ("code", "status", "kind"),
    [
        ("EntityTooLarge", 400, StorageFull),  # Swift s3api's quota answer
        ("QuotaExceeded", 403, StorageFull),
        ("", 413, StorageFull),
        ("AccessDenied", 403, StorageAccessDenied),
        ("SignatureDoesNotMatch", 403, StorageAccessDenied),
        ("InvalidAccessKeyId", 403, StorageAccessDenied),
        ("", 403, StorageAccessDenied),  # a HEAD answer has no body
        ("NoSuchBucket", 404, StorageNotFound),
        ("NoSuchKey", 404, ObjectMissing),
        ("NoSuchUpload", 404, ObjectMissing),
        ("", 404, ObjectMissing),
        ("SlowDown", 503, StorageUnavailable),
        ("InternalError", 500, StorageUnavailable),
        ("", 502, StorageUnavailable),
        ("InvalidRange", 416, StorageError),
    ],
)
def test_client_errors_map_to_named_dcs_errors(code: str, status: int, kind: type[BaseException]) -> None:
    mapped = translate(client_error(code, status, "m" * 5000), "UPLOAD-PART", "bkt", "run/step-000000001/f")
    assert type(mapped) is kind
    text = str(mapped)
    assert text.startswith("UPLOAD-PART s3://bkt/run/step-000000001/f:"), text
    assert (code or str(status)) in text
    assert len(text) < 400, "a server's message is cut, not copied whole"
    # only a store that could not be reached is retried by the worker; a full or refusing store fails at once
    assert isinstance(mapped, RETRYABLE) is (kind is StorageUnavailable)


def test_connection_errors_are_unavailable_and_retried() -> None:
    for exc in (
        bx.EndpointConnectionError(endpoint_url="http://127.0.0.1:1/b/k"),
        bx.ConnectTimeoutError(endpoint_url="http://127.0.0.1:1/b/k"),
        bx.ReadTimeoutError(endpoint_url="http://127.0.0.1:1/b/k"),
        bx.ConnectionClosedError(endpoint_url="http://127.0.0.1:1/b/k"),
    ):
        mapped = translate(exc, "GET", "bkt", "k")
        assert isinstance(mapped, StorageUnavailable) and isinstance(mapped, RETRYABLE), exc
        assert "GET s3://bkt/k" in str(mapped)


def test_missing_credentials_are_access_denied_and_other_exceptions_pass_through() -> None:
    mapped = translate(bx.NoCredentialsError(), "LIST", "bkt", "")
    assert isinstance(mapped, StorageAccessDenied) and "LIST s3://bkt:" in str(mapped)
    other = KeyError("x")
    assert translate(other, "GET", "bkt", "k") is other


@pytest.mark.parametrize(
    "key",
    [
        "run/step-000000001/../x",
        "run/./step-000000001/manifest.json",
        "run//step",
        "/run",
        "run/",
        "..",
        "run\\step",
        "run/step\x00",
        "run/\x7fstep",
        "run/step\n",
        "k" * (MAX_KEY_BYTES + 1),
        "é" * (MAX_KEY_BYTES // 2 + 1),  # the limit is in bytes
    ],
)
def test_hostile_keys_are_refused(key: str) -> None:
    with pytest.raises(ValueError, match="object key"):
        check_key(key)


@pytest.mark.parametrize("key", ["", "run/step-000000001/manifest.json", "a b/step-+5/c..d", "k" * MAX_KEY_BYTES])
def test_clean_keys_pass(key: str) -> None:
    assert check_key(key) == key


def test_view_reader_reads_seeks_back_for_a_retry_and_never_copies_past_its_view() -> None:
    data = bytes(range(256)) * 40
    with memoryview(data) as whole, whole[100:9000] as view:
        reader = ViewReader(view)
        assert len(reader) == 8900 and reader.seekable() and reader.readable()
        first = bytes(reader.read(1000)) + bytes(reader.read())
        assert first == data[100:9000] and reader.read(10) == b""
        assert reader.seek(0) == 0  # botocore rewinds the body to resend a part
        buf = bytearray(5000)
        assert reader.readinto(buf) == 5000 and bytes(buf) == data[100:5100]
        assert reader.seek(-10, io.SEEK_END) == 8890 and reader.read() == data[8990:9000]
        assert reader.seek(5, io.SEEK_CUR) == 8900  # clamped to the end
        assert reader.seek(-99999, io.SEEK_CUR) == 0
        del reader
