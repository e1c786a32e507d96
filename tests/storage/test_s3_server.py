"""The S3 server of the storage tests (Swift + s3api, tests/helpers/s3server.py) speaks real S3 to boto3: what
the storage code relies on (ranged reads, multipart uploads, listings, refusals, quotas, restarts) behaves as
S3 does, with the error codes named in the helper's docstring."""

from __future__ import annotations

import hashlib
import os
from typing import Any

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError, EndpointConnectionError

from tests.helpers.s3server import S3Server
from tests.storage.conftest import S3Bucket, s3_client

pytestmark = pytest.mark.integration

MiB = 1024 * 1024


def error_code(exc: pytest.ExceptionInfo[ClientError]) -> tuple[str, int]:
    response: dict[str, Any] = exc.value.response
    return response["Error"]["Code"], response["ResponseMetadata"]["HTTPStatusCode"]


def test_put_get_and_ranged_get(s3_bucket: S3Bucket) -> None:
    s3 = s3_bucket.client()
    data = os.urandom(100_000)
    put = s3.put_object(Bucket=s3_bucket.bucket, Key="a/blob", Body=data)
    assert put["ETag"] == f'"{hashlib.md5(data).hexdigest()}"'

    got = s3.get_object(Bucket=s3_bucket.bucket, Key="a/blob")
    assert got["Body"].read() == data
    assert got["ContentLength"] == len(data)

    for header, start, end in (
        ("bytes=0-0", 0, 0),
        ("bytes=1000-1999", 1000, 1999),
        ("bytes=99990-", 99990, 99999),
        ("bytes=-7", len(data) - 7, len(data) - 1),
        ("bytes=99000-200000", 99000, 99999),  # past the end: cut at the end, as S3 does
    ):
        part = s3.get_object(Bucket=s3_bucket.bucket, Key="a/blob", Range=header)
        assert part["ResponseMetadata"]["HTTPStatusCode"] == 206
        assert part["ContentRange"] == f"bytes {start}-{end}/{len(data)}"
        assert part["Body"].read() == data[start : end + 1], header

    with pytest.raises(ClientError) as missing:
        s3.get_object(Bucket=s3_bucket.bucket, Key="a/none")
    assert error_code(missing) == ("NoSuchKey", 404)
    with pytest.raises(ClientError) as unsatisfiable:
        s3.get_object(Bucket=s3_bucket.bucket, Key="a/blob", Range="bytes=100000-100001")
    assert error_code(unsatisfiable) == ("InvalidRange", 416)


def test_multipart_upload_listed_aborted_and_completed(s3_bucket: S3Bucket) -> None:
    s3 = s3_bucket.client()
    bucket = s3_bucket.bucket
    parts_data = [os.urandom(5 * MiB) for _ in range(3)] + [os.urandom(MiB // 3)]

    aborted = s3.create_multipart_upload(Bucket=bucket, Key="ckpt/aborted")["UploadId"]
    s3.upload_part(Bucket=bucket, Key="ckpt/aborted", UploadId=aborted, PartNumber=1, Body=parts_data[0])
    upload_id = s3.create_multipart_upload(Bucket=bucket, Key="ckpt/model.safetensors")["UploadId"]
    parts = []
    for number, body in enumerate(parts_data, start=1):
        answer = s3.upload_part(
            Bucket=bucket, Key="ckpt/model.safetensors", UploadId=upload_id, PartNumber=number, Body=body
        )
        assert answer["ETag"] == f'"{hashlib.md5(body).hexdigest()}"'
        parts.append({"PartNumber": number, "ETag": answer["ETag"]})

    uploads = s3.list_multipart_uploads(Bucket=bucket)["Uploads"]
    assert {(u["Key"], u["UploadId"]) for u in uploads} == {
        ("ckpt/aborted", aborted),
        ("ckpt/model.safetensors", upload_id),
    }
    listed = s3.list_parts(Bucket=bucket, Key="ckpt/model.safetensors", UploadId=upload_id)["Parts"]
    assert [(p["PartNumber"], p["Size"]) for p in listed] == [(i + 1, len(b)) for i, b in enumerate(parts_data)]
    assert "Contents" not in s3.list_objects_v2(Bucket=bucket)  # nothing visible before completion

    s3.abort_multipart_upload(Bucket=bucket, Key="ckpt/aborted", UploadId=aborted)
    uploads = s3.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    assert [(u["Key"], u["UploadId"]) for u in uploads] == [("ckpt/model.safetensors", upload_id)]
    with pytest.raises(ClientError) as gone:
        s3.list_parts(Bucket=bucket, Key="ckpt/aborted", UploadId=aborted)
    assert error_code(gone) == ("NoSuchUpload", 404)

    done = s3.complete_multipart_upload(
        Bucket=bucket, Key="ckpt/model.safetensors", UploadId=upload_id, MultipartUpload={"Parts": parts}
    )
    md5_of_md5s = hashlib.md5(b"".join(hashlib.md5(b).digest() for b in parts_data)).hexdigest()
    assert done["ETag"] == f'"{md5_of_md5s}-4"'  # AWS's multipart ETag
    assert "Uploads" not in s3.list_multipart_uploads(Bucket=bucket)

    whole = b"".join(parts_data)
    got = s3.get_object(Bucket=bucket, Key="ckpt/model.safetensors")
    assert got["ContentLength"] == len(whole)
    assert hashlib.sha256(got["Body"].read()).digest() == hashlib.sha256(whole).digest()
    # a range across the boundary of parts 1 and 2
    across = s3.get_object(Bucket=bucket, Key="ckpt/model.safetensors", Range=f"bytes={5 * MiB - 10}-{5 * MiB + 9}")
    assert across["Body"].read() == whole[5 * MiB - 10 : 5 * MiB + 10]
    [listed_object] = s3.list_objects_v2(Bucket=bucket)["Contents"]
    assert (listed_object["Key"], listed_object["Size"]) == ("ckpt/model.safetensors", len(whole))


def test_multipart_parts_below_the_minimum_are_refused(s3_bucket: S3Bucket) -> None:
    s3 = s3_bucket.client()
    upload_id = s3.create_multipart_upload(Bucket=s3_bucket.bucket, Key="small")["UploadId"]
    parts = [
        {
            "PartNumber": n,
            "ETag": s3.upload_part(
                Bucket=s3_bucket.bucket, Key="small", UploadId=upload_id, PartNumber=n, Body=b"x" * 1000
            )["ETag"],
        }
        for n in (1, 2)
    ]
    with pytest.raises(ClientError) as small:
        s3.complete_multipart_upload(
            Bucket=s3_bucket.bucket, Key="small", UploadId=upload_id, MultipartUpload={"Parts": parts}
        )
    assert error_code(small) == ("EntityTooSmall", 400)


def test_list_objects_v2_prefix_delimiter_and_continuation(s3_bucket: S3Bucket) -> None:
    s3 = s3_bucket.client()
    keys = [f"run/step-{i:03d}/shard-{j}" for i in range(4) for j in range(2)] + ["run/latest", "other/x"]
    for key in keys:
        s3.put_object(Bucket=s3_bucket.bucket, Key=key, Body=key.encode())

    top = s3.list_objects_v2(Bucket=s3_bucket.bucket, Prefix="run/", Delimiter="/")
    assert [o["Key"] for o in top["Contents"]] == ["run/latest"]
    assert [p["Prefix"] for p in top["CommonPrefixes"]] == [f"run/step-{i:03d}/" for i in range(4)]
    assert top["KeyCount"] == 5

    seen: list[str] = []
    pages = 0
    kwargs: dict[str, Any] = {"Bucket": s3_bucket.bucket, "Prefix": "run/step-", "MaxKeys": 3}
    while True:
        page = s3.list_objects_v2(**kwargs)
        pages += 1
        seen += [o["Key"] for o in page.get("Contents", [])]
        if not page["IsTruncated"]:
            break
        kwargs["ContinuationToken"] = page["NextContinuationToken"]
    assert pages == 3
    assert seen == sorted(k for k in keys if k.startswith("run/step-"))

    paginated = [
        o["Key"]
        for page in s3.get_paginator("list_objects_v2").paginate(
            Bucket=s3_bucket.bucket, PaginationConfig={"PageSize": 4}
        )
        for o in page.get("Contents", [])
    ]
    assert paginated == sorted(keys)


def test_other_user_is_denied(s3_bucket: S3Bucket) -> None:
    s3_bucket.client().put_object(Bucket=s3_bucket.bucket, Key="secret", Body=b"mine")
    intruder = s3_bucket.client(other_user=True)
    for call, kwargs in (
        (intruder.get_object, {"Key": "secret"}),
        (intruder.put_object, {"Key": "planted", "Body": b"x"}),
        (intruder.delete_object, {"Key": "secret"}),
        (intruder.list_objects_v2, {}),
        (intruder.create_multipart_upload, {"Key": "planted"}),
    ):
        with pytest.raises(ClientError) as denied:
            call(Bucket=s3_bucket.bucket, **kwargs)
        assert error_code(denied) == ("AccessDenied", 403), call
    owner = s3_bucket.client()
    assert [o["Key"] for o in owner.list_objects_v2(Bucket=s3_bucket.bucket)["Contents"]] == ["secret"]

    wrong_secret = boto3.client(
        "s3",
        endpoint_url=s3_bucket.endpoint_url,
        aws_access_key_id=s3_bucket.access_key,
        aws_secret_access_key="not-the-secret",
        region_name=s3_bucket.region,
        config=Config(s3={"addressing_style": "path"}),
    )
    with pytest.raises(ClientError) as refused:
        wrong_secret.get_object(Bucket=s3_bucket.bucket, Key="secret")
    assert error_code(refused) == ("SignatureDoesNotMatch", 403)


def test_quota_exceeded(s3_bucket: S3Bucket) -> None:
    s3 = s3_bucket.client()
    bucket = s3_bucket.bucket
    s3_bucket.set_quota(6 * MiB)

    s3.put_object(Bucket=bucket, Key="fits", Body=b"x" * 1000)
    with pytest.raises(ClientError) as put_full:
        s3.put_object(Bucket=bucket, Key="too-big", Body=b"x" * (6 * MiB))
    assert error_code(put_full) == ("EntityTooLarge", 400)

    upload_id = s3.create_multipart_upload(Bucket=bucket, Key="big")["UploadId"]
    first = s3.upload_part(Bucket=bucket, Key="big", UploadId=upload_id, PartNumber=1, Body=os.urandom(5 * MiB))
    with pytest.raises(ClientError) as part_full:  # the parts' container holds 5 MiB of its 6 MiB
        s3.upload_part(Bucket=bucket, Key="big", UploadId=upload_id, PartNumber=2, Body=os.urandom(5 * MiB))
    assert error_code(part_full) == ("EntityTooLarge", 400)

    # CompleteMultipartUpload writes a manifest of a few hundred bytes into the bucket: refused once the bucket
    # itself is full
    s3_bucket.server.set_bucket_quota(bucket, 1000, segments=False)
    with pytest.raises(ClientError) as complete_full:
        s3.complete_multipart_upload(
            Bucket=bucket,
            Key="big",
            UploadId=upload_id,
            MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": first["ETag"]}]},
        )
    assert error_code(complete_full) == ("EntityTooLarge", 400)

    s3_bucket.set_quota(None)
    s3.put_object(Bucket=bucket, Key="too-big", Body=b"x" * (6 * MiB))
    s3.complete_multipart_upload(
        Bucket=bucket,
        Key="big",
        UploadId=upload_id,
        MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": first["ETag"]}]},
    )
    assert s3.head_object(Bucket=bucket, Key="big")["ContentLength"] == 5 * MiB


def test_default_request_checksums_are_checked(s3_bucket: S3Bucket) -> None:
    """boto3 >= 1.36 sends x-amz-checksum-crc32 with every upload by default (a header over plain HTTP): s3api
    accepts it and refuses a checksum that does not match the body. A client that sends none works too."""
    s3 = s3_bucket.client()
    sent: list[dict[str, str]] = []
    s3.meta.events.register("before-send.s3.PutObject", lambda request, **_: sent.append(dict(request.headers)))
    s3.put_object(Bucket=s3_bucket.bucket, Key="crc", Body=b"hello")
    assert "x-amz-checksum-crc32" in {k.lower() for k in sent[-1]}
    s3.put_object(Bucket=s3_bucket.bucket, Key="sha", Body=b"hello", ChecksumAlgorithm="SHA256")
    assert "x-amz-checksum-sha256" in {k.lower() for k in sent[-1]}
    assert s3.get_object(Bucket=s3_bucket.bucket, Key="sha")["Body"].read() == b"hello"

    with pytest.raises(ClientError) as mismatch:
        s3.put_object(Bucket=s3_bucket.bucket, Key="bad", Body=b"hello", ChecksumCRC32="AAAAAA==")
    assert error_code(mismatch) == ("BadDigest", 400)

    plain = s3_bucket.client(request_checksum_calculation="when_required", response_checksum_validation="when_required")
    plain.put_object(Bucket=s3_bucket.bucket, Key="plain", Body=b"hello")
    assert plain.get_object(Bucket=s3_bucket.bucket, Key="plain")["Body"].read() == b"hello"


@pytest.mark.parametrize("own_s3_server", [{"tls": True}], indirect=True)
def test_https_streaming_uploads_with_trailing_checksums(own_s3_server: S3Server) -> None:
    """Over HTTPS boto3 >= 1.36 sends uploads as aws-chunked bodies with the checksum in a trailer
    (STREAMING-UNSIGNED-PAYLOAD-TRAILER), as it does against AWS: s3api takes them, multipart included, and a
    quota still refuses them up front (it reads X-Amz-Decoded-Content-Length)."""
    server = own_s3_server
    assert server.endpoint_url.startswith("https://")
    s3 = s3_client(server)
    sent: list[dict[str, str]] = []
    s3.meta.events.register("before-send.s3", lambda request, **_: sent.append(dict(request.headers)))
    s3.create_bucket(Bucket="tls")
    data = os.urandom(3 * MiB)
    s3.put_object(Bucket="tls", Key="obj", Body=data)
    assert sent[-1]["X-Amz-Content-SHA256"] == b"STREAMING-UNSIGNED-PAYLOAD-TRAILER"
    assert sent[-1]["X-Amz-Trailer"] == b"x-amz-checksum-crc32"
    assert s3.get_object(Bucket="tls", Key="obj", Range="bytes=5-9")["Body"].read() == data[5:10]

    upload_id = s3.create_multipart_upload(Bucket="tls", Key="mp")["UploadId"]
    parts = []
    for number, body in enumerate((data + data, data), start=1):
        answer = s3.upload_part(Bucket="tls", Key="mp", UploadId=upload_id, PartNumber=number, Body=body)
        assert sent[-1]["Content-Encoding"] == b"aws-chunked"
        parts.append({"PartNumber": number, "ETag": answer["ETag"]})
    s3.complete_multipart_upload(Bucket="tls", Key="mp", UploadId=upload_id, MultipartUpload={"Parts": parts})
    assert s3.get_object(Bucket="tls", Key="mp")["Body"].read() == data * 3

    server.set_bucket_quota("tls", 4 * MiB)
    with pytest.raises(ClientError) as full:
        s3.put_object(Bucket="tls", Key="more", Body=data)
    assert sent[-1]["Content-Encoding"] == b"aws-chunked"
    assert error_code(full) == ("EntityTooLarge", 400)


def test_restart_and_kill_keep_objects(own_s3_server: S3Server) -> None:
    server = own_s3_server
    s3 = s3_client(server, retries={"max_attempts": 1}, connect_timeout=2)
    s3.create_bucket(Bucket="kept")
    data = os.urandom(3 * MiB)
    s3.put_object(Bucket="kept", Key="obj", Body=data)
    ports = dict(server.ports)

    server.restart()
    assert server.ports == ports
    assert s3.get_object(Bucket="kept", Key="obj")["Body"].read() == data

    storage_pids = {kind: proc.pid for kind, proc in server.procs.items() if kind != "proxy"}
    proxy_pid = server.procs["proxy"].pid
    server.kill()  # the proxy only
    with pytest.raises(EndpointConnectionError):
        s3.get_object(Bucket="kept", Key="obj")
    assert {kind: proc.pid for kind, proc in server.procs.items()} == storage_pids
    assert_gone(proxy_pid)

    server.kill(everything=True)
    for pid in storage_pids.values():
        assert_gone(pid)
    server.start()
    assert s3.get_object(Bucket="kept", Key="obj")["Body"].read() == data
    assert [o["Key"] for o in s3.list_objects_v2(Bucket="kept")["Contents"]] == ["obj"]

    pids = [proc.pid for proc in server.procs.values()]
    server.stop()
    for pid in pids:
        assert_gone(pid)


def assert_gone(pgid: int) -> None:
    """No process is left in the process group (each server runs in a session of its own)."""
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)
