"""S3 (and S3-compatible) object storage for checkpoints: botocore's low-level client, our own parallelism.

Why this client: boto3/botocore reads credentials from the standard AWS chain (environment, shared
`~/.aws/credentials` and `config` files, `AWS_PROFILE`, container and instance roles), takes an endpoint URL and
path-style addressing for S3-compatible servers (`AWS_ENDPOINT_URL` too), retries throttling and 5xx with
backoff (`standard` mode), and its low-level client is thread-safe. The bytes do not go through s3transfer,
nor through a Python copy: uploads lend botocore slices of the staging mapping (`ViewReader`) and hash them in
order while they travel; ranged GETs are read from the HTTP response straight into the destination tensors
(`_direct_stream`); s3transfer can do neither (it hashes nothing and lands downloads in a file or a buffer of its
own). Bodies are SHA-256-signed only where `s3_payload_signing` says so (`client`: by default over plain http, not
over https, where TLS carries their integrity). `bench/storage.py` measures this against s3transfer, obstore, s3fs
(DCP's `FsspecWriter`/`FsspecReader`) and s3torchconnector on the same server; docs/checkpoints.md says why this
client.

Every call maps botocore's errors to DCS's: `StorageAccessDenied` (never retried), `StorageFull`,
`StorageNotFound`, `StorageUnavailable` (a ConnectionError: retried by the worker). Messages name the bucket,
key and operation; credentials never appear in them and are never logged: botocore puts no AWS key in its
errors, and a `user:password@` in `DCS_S3_ENDPOINT_URL` never reaches botocore (`endpoint_without_credentials`:
S3 requests are signed with the AWS credentials and send only the path, so botocore never used it; its errors
and debug log print the endpoint URL) and is masked in every message that quotes a URL.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import http.client
import io
import os
import threading
import urllib.parse
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from dcs_tasks.config import mask_url_credentials
from dcs_tasks.errors import (
    CorruptCheckpoint,
    StorageAccessDenied,
    StorageError,
    StorageFull,
    StorageNotFound,
    StorageUnavailable,
)
from dcs_tasks.storage.store import Refused
from dcs_tasks.storage_url import ObjectURL, check_key

MiB = 1024 * 1024
MIN_PART_BYTES = 5 * MiB  # S3: every part but the last is at least 5 MiB
MAX_PARTS = 1_000  # parts per upload: AWS allows 10,000, Swift s3api 1,000; larger files get larger parts
LEND_BYTES = 1 * MiB  # the least `ViewReader.read` lends (urllib3 asks for 16 KiB at a time)
MAX_LISTED_KEYS = 1_000_000  # a listing longer than this is refused (a hostile or runaway bucket)

DENIED = frozenset(
    {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AllAccessDisabled", "InvalidToken", "403"}
)
FULL = frozenset({"QuotaExceeded", "EntityTooLarge", "XAmzContentSHA256Mismatch-NotFull", "413"})
MISSING_BUCKET = frozenset({"NoSuchBucket"})
MISSING_KEY = frozenset({"NoSuchKey", "404", "NotFound", "NoSuchUpload"})


@dataclass(frozen=True)
class S3Settings:
    """How DCS talks to the store (from `DCSConfig`'s `s3_*` settings). Credentials are not here: boto3 reads
    them from the standard AWS chain."""

    endpoint_url: str | None = None
    region: str | None = None
    addressing_style: str = "auto"  # path for most S3-compatible servers
    part_bytes: int = 32 * MiB
    concurrency: int = 8
    read_concurrency: int = 16
    max_attempts: int = 5
    connect_timeout: float = 10.0
    read_timeout: float = 60.0
    payload_signing: str = "auto"  # on / off / auto (off over https, on over http): `s3_payload_signing`


class ObjectMissing(StorageError):
    """The key does not exist (a reader decides whether that is corruption or absence)."""


def translate(exc: BaseException, op: str, bucket: str, key: str) -> BaseException:
    """A DCS error for a botocore error of `op` on s3://bucket/key (other exceptions are returned as they are)."""
    from botocore import exceptions as bx

    where = f"s3://{bucket}/{key}" if key else f"s3://{bucket}"
    if isinstance(exc, bx.ClientError):
        err = exc.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = str(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
        message = _said(err.get("Message", ""))
        detail = f"{op} {where}: {code or status} {message}".strip()
        if code in DENIED or (not code and status == "403"):
            return StorageAccessDenied(f"{detail} (check the AWS credentials and the bucket's permissions)")
        if code in FULL or status == "413":
            return StorageFull(f"{detail} (the store or the bucket's quota is full)")
        if code in MISSING_BUCKET:
            return StorageNotFound(f"{detail} (create the bucket first)")
        if code in MISSING_KEY or status == "404":
            return ObjectMissing(detail)
        if status.startswith("5") or code in ("SlowDown", "RequestTimeout", "ServiceUnavailable", "InternalError"):
            return StorageUnavailable(f"{detail} (after retries)")
        return StorageError(detail)
    if isinstance(exc, bx.NoCredentialsError | bx.PartialCredentialsError):
        return StorageAccessDenied(f"{op} {where}: no AWS credentials found (environment, shared files or role)")
    if isinstance(exc, bx.EndpointConnectionError | bx.ConnectTimeoutError | bx.ReadTimeoutError):
        return StorageUnavailable(f"{op} {where}: {type(exc).__name__}: {_said(exc)}")
    if isinstance(exc, bx.ConnectionClosedError | bx.HTTPClientError | bx.ResponseStreamingError):
        return StorageUnavailable(f"{op} {where}: {type(exc).__name__}: {_said(exc)}")
    return exc


def _said(what: object) -> str:
    """The first 200 characters of an error's text, credentials of any URL in it masked."""
    return mask_url_credentials(str(what))[:200]


def endpoint_without_credentials(url: str | None) -> str | None:
    """`url` without its `user:password@` (what botocore is given: see the module docstring)."""
    if not url:
        return url
    parts = urllib.parse.urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


class ViewReader(io.RawIOBase):
    """A seekable, read-only file over a memoryview: a part's body without copying the staging mapping.

    `read` hands out slices of the view itself, not copies: botocore hashes them for the request's signature (where
    the payload is signed: `s3_payload_signing`) and urllib3 passes them to `sendall`, so a part travels from the
    staging mapping to the socket with no copy in Python. Every slice handed out is released by `close()` (the owner
    of the mapping must be able to close it, even after an error whose traceback still references a slice); `seek`
    lets botocore rewind the body to resend a part."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view = view
        self._pos = 0
        self._lent: list[memoryview] = []

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        n = min(len(buf), len(self._view) - self._pos)
        buf[:n] = self._view[self._pos : self._pos + n]
        self._pos += n
        return n

    def read(self, size: int | None = -1) -> memoryview:
        # At least LEND_BYTES however little is asked: urllib3 sends a file-like body 16 KiB per read + `sendall`
        # (2,048 rounds of Python per 32 MiB part); its callers (urllib3's sender, botocore's hashers) take what
        # a read returns, and a slice costs nothing, so a part goes out in 1 MiB `sendall`s.
        end = len(self._view) if size is None or size < 0 else min(len(self._view), self._pos + max(size, LEND_BYTES))
        piece = self._view[self._pos : end]
        self._lent.append(piece)
        self._pos = end
        return piece

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, min(len(self._view), base + offset))
        return self._pos

    def tell(self) -> int:
        return self._pos

    def close(self) -> None:
        lent, self._lent = self._lent, []
        for piece in lent:
            piece.release()
        super().close()

    def __len__(self) -> int:
        return len(self._view)


_clients: dict[tuple[int, S3Settings, str | None, str | None, str], Any] = {}
_clients_lock = threading.Lock()
# boto3 sessions by credential environment; a child forked after `prewarm` reuses the parent's loaded models
_sessions: dict[tuple[str | None, str | None, str], Any] = {}


def _secret_digest() -> str:
    """A digest of the secret parts of the credential environment (a changed secret or session token under the
    same key id needs a new session too; the values themselves are never kept)."""
    raw = "\0".join(os.environ.get(name, "") for name in ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"))
    return hashlib.sha256(raw.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def prewarm(settings: S3Settings) -> None:
    """Make this process's client now (botocore loads the S3 service model: ~1 s of CPU on a small machine).
    Called in a worker before it forks its pool (the children inherit the loaded models) and in each child."""
    client(settings)


def payload_unsigned_by_default(endpoint_url: str) -> bool:
    """Whether `s3_payload_signing = "auto"` sends UNSIGNED-PAYLOAD to `endpoint_url` (the one the client
    resolved): over https only, where TLS carries the body's integrity; over http the signature is all there is."""
    return endpoint_url.lower().startswith("https://")


def client(settings: S3Settings) -> Any:
    """One botocore S3 client per process and settings (clients are thread-safe; a forked child makes its own)."""
    # a process that changes its credential environment gets a new client (a cached one keeps what it resolved)
    key = (os.getpid(), settings, os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_PROFILE"), _secret_digest())
    with _clients_lock:
        found = _clients.get(key)
        if found is None:
            import boto3
            from botocore.config import Config

            session = _sessions.get(key[2:])
            if session is None:  # a session caches the credentials it resolved: one per credential environment
                session = _sessions[key[2:]] = boto3.session.Session()
            endpoint = endpoint_without_credentials(settings.endpoint_url)

            def make(sign: bool) -> Any:
                s3 = {"addressing_style": settings.addressing_style, "payload_signing_enabled": sign}
                config = Config(
                    region_name=settings.region,
                    retries={"mode": "standard", "max_attempts": settings.max_attempts},
                    max_pool_connections=max(10, settings.concurrency * 2, settings.read_concurrency + 2),
                    connect_timeout=settings.connect_timeout,
                    read_timeout=settings.read_timeout,
                    s3=s3,
                    request_checksum_calculation="when_required",
                    response_checksum_validation="when_required",
                )
                return session.client("s3", endpoint_url=endpoint, config=config)

            signing = settings.payload_signing
            found = make(signing != "off")  # `auto` signs until the endpoint is known to be https
            if signing == "auto" and payload_unsigned_by_default(found.meta.endpoint_url):
                found = make(False)  # the endpoint botocore resolved (ours, AWS_ENDPOINT_URL, AWS's) is https
            _clients[key] = found
        return found


@dataclass(frozen=True)
class Listed:
    key: str
    size: int


class S3Store:
    """Objects under one bucket. Keys are full keys (prefix included), checked on the way in and out."""

    def __init__(self, url: ObjectURL, settings: S3Settings) -> None:
        self.url = url
        self.bucket = url.bucket
        self.settings = settings

    def __repr__(self) -> str:
        return f"S3Store({self.url})"

    @property
    def client(self) -> Any:
        return client(self.settings)

    def _call(self, op: str, key: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as exc:
            mapped = translate(exc, op, self.bucket, key)
            if mapped is exc:
                raise
            raise mapped from None

    # --- small objects ---------------------------------------------------------------------------
    def head(self, key: str) -> int | None:
        """The object's size, or None when it does not exist."""
        try:
            answer = self._call("HEAD", key, lambda: self.client.head_object(Bucket=self.bucket, Key=key))
        except ObjectMissing:
            return None
        return int(answer["ContentLength"])

    def get_small(self, key: str, limit: int) -> bytes:
        """The whole object when it holds at most `limit` bytes: ObjectMissing when absent, CorruptCheckpoint
        when bigger (only `limit` + 1 bytes are ever read)."""
        answer = self._call(
            "GET", key, lambda: self.client.get_object(Bucket=self.bucket, Key=key, Range=f"bytes=0-{limit}")
        )
        body = answer["Body"]
        try:
            data = self._call("GET", key, lambda: body.read(limit + 1))
        finally:
            body.close()
        if len(data) > limit:
            raise CorruptCheckpoint(
                f"s3://{self.bucket}/{key} is larger than {limit} bytes", f"s3://{self.bucket}/{key}"
            )
        return bytes(data)

    def put_small(self, key: str, data: bytes | bytearray) -> None:
        """One PUT: the object appears whole or not at all."""
        self._call(
            "PUT",
            key,
            lambda: self.client.put_object(Bucket=self.bucket, Key=key, Body=data, ContentLength=len(data)),
        )

    def delete(self, keys: list[str]) -> None:
        for start in range(0, len(keys), 1000):  # DeleteObjects takes 1000 keys
            batch = keys[start : start + 1000]
            request = {"Objects": [{"Key": k} for k in batch], "Quiet": True}
            answer = self._call(
                "DELETE", batch[0], functools.partial(self.client.delete_objects, Bucket=self.bucket, Delete=request)
            )
            errors = [e for e in answer.get("Errors", []) if e.get("Code") not in MISSING_KEY]
            if errors:
                first = errors[0]
                raise StorageError(
                    f"DELETE s3://{self.bucket}/{str(first.get('Key'))[:256]}: {first.get('Code')} "
                    f"({len(errors)} of {len(batch)} keys not deleted)"
                )

    # --- listings ------------------------------------------------------------------------------
    def objects(self, prefix: str, limit: int = MAX_LISTED_KEYS) -> Iterator[Listed]:
        """Every object under `prefix` (keys checked: one with a bad component is skipped), at most `limit`
        (more raises StorageError: a listing that long is not a checkpoint tree). Skipped keys do not count
        towards `limit` (`limit=1` asks "is there any object?", whatever hostile key sorts first) but do
        towards MAX_LISTED_KEYS, so a listing of junk stays bounded."""
        paginator = self.client.get_paginator("list_objects_v2")
        seen = scanned = 0
        bound = max(limit, MAX_LISTED_KEYS)
        pages = self._call("LIST", prefix, lambda: iter(paginator.paginate(Bucket=self.bucket, Prefix=prefix)))
        while True:
            page = self._call("LIST", prefix, lambda: next(pages, None))
            if page is None:
                return
            for item in page.get("Contents", []):
                scanned += 1
                if scanned > bound:
                    raise StorageError(f"LIST s3://{self.bucket}/{prefix}: more than {bound} objects")
                key = str(item.get("Key", ""))
                try:
                    check_key(key)
                except ValueError:
                    continue
                seen += 1
                if seen > limit:
                    raise StorageError(f"LIST s3://{self.bucket}/{prefix}: more than {limit} objects")
                yield Listed(key, int(item.get("Size", 0)))

    def children(self, prefix: str, limit: int = MAX_LISTED_KEYS) -> list[str]:
        """The names directly under `prefix` + '/' that hold objects (common prefixes), checked."""
        paginator = self.client.get_paginator("list_objects_v2")
        base = prefix + "/" if prefix else ""
        names: list[str] = []
        pages = self._call(
            "LIST", prefix, lambda: iter(paginator.paginate(Bucket=self.bucket, Prefix=base, Delimiter="/"))
        )
        while True:
            page = self._call("LIST", prefix, lambda: next(pages, None))
            if page is None:
                return names
            for item in page.get("CommonPrefixes", []):
                name = str(item.get("Prefix", ""))[len(base) :].rstrip("/")
                if name and "/" not in name and name not in (".", ".."):
                    names.append(name)
                    if len(names) > limit:
                        raise StorageError(f"LIST s3://{self.bucket}/{prefix}: more than {limit} entries")

    # --- multipart uploads ----------------------------------------------------------------------
    def open_uploads(self, prefix: str) -> list[tuple[str, str]]:
        """(key, upload id) of every multipart upload under `prefix` not yet completed or aborted."""
        out: list[tuple[str, str]] = []
        paginator = self.client.get_paginator("list_multipart_uploads")
        pages = self._call("LIST-UPLOADS", prefix, lambda: iter(paginator.paginate(Bucket=self.bucket, Prefix=prefix)))
        while True:
            page = self._call("LIST-UPLOADS", prefix, lambda: next(pages, None))
            if page is None:
                return out
            for item in page.get("Uploads", []):
                out.append((str(item.get("Key", "")), str(item.get("UploadId", ""))))
                if len(out) > MAX_LISTED_KEYS:
                    raise StorageError(f"LIST-UPLOADS s3://{self.bucket}/{prefix}: too many open uploads")

    def abort_uploads(self, prefix: str) -> int:
        """Abort every incomplete multipart upload under `prefix`; returns how many."""
        count = 0
        for key, upload_id in self.open_uploads(prefix):
            try:
                self._call(
                    "ABORT",
                    key,
                    functools.partial(
                        self.client.abort_multipart_upload, Bucket=self.bucket, Key=key, UploadId=upload_id
                    ),
                )
            except ObjectMissing:
                continue  # aborted or completed meanwhile
            count += 1
        return count

    def upload(
        self,
        key: str,
        view: memoryview,
        hasher: Any,
        publish: Callable[[], bool] | None = None,
        on_bytes: Callable[[int], None] | None = None,
    ) -> None:
        """Store `view` as `key`: parallel multipart upload (`part_bytes`, `concurrency`), the bytes hashed in
        order into `hasher` while the parts travel. The object becomes visible only when complete; on any
        failure the upload is aborted (nothing half-written stays open). `publish` is asked once every part is
        stored, just before the object appears; False aborts it and raises NotPublishedObject."""
        size = len(view)
        part = max(MIN_PART_BYTES, self.settings.part_bytes, -(-size // MAX_PARTS))
        if size <= part:
            body = bytes(view)  # read once: the bytes that are hashed are the bytes that are sent
            hasher.update(body)
            if publish is not None and not publish():
                raise NotPublishedObject(f"s3://{self.bucket}/{key} was not written: the publish check refused it")
            self._call(
                "PUT", key, lambda: self.client.put_object(Bucket=self.bucket, Key=key, Body=body, ContentLength=size)
            )
            if on_bytes is not None:
                on_bytes(size)
            return
        created = self._call(
            "CREATE-UPLOAD", key, lambda: self.client.create_multipart_upload(Bucket=self.bucket, Key=key)
        )
        upload_id = str(created["UploadId"])
        try:
            parts = self._upload_parts(key, upload_id, view, part, hasher, on_bytes)
            if publish is not None and not publish():
                raise NotPublishedObject(f"s3://{self.bucket}/{key} was not written: the publish check refused it")
            self._call(
                "COMPLETE-UPLOAD",
                key,
                lambda: self.client.complete_multipart_upload(
                    Bucket=self.bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
                ),
            )
        except BaseException:
            try:
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
            except Exception:  # noqa: S110 - gc sweeps what an abort could not (the original error is raised)
                pass
            raise

    def start_upload(self, key: str) -> str:
        """A new multipart upload of `key`; its id. Nothing is visible at `key` until `complete_upload`."""
        created = self._call(
            "CREATE-UPLOAD", key, lambda: self.client.create_multipart_upload(Bucket=self.bucket, Key=key)
        )
        return str(created["UploadId"])

    def put_part(self, key: str, upload_id: str, number: int, data: bytes | bytearray) -> dict[str, Any]:
        """Part `number` (from 1) of an upload; what `complete_upload` needs of it."""
        answer = self._call(
            "UPLOAD-PART",
            key,
            lambda: self.client.upload_part(
                Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=data, ContentLength=len(data)
            ),
        )
        return {"PartNumber": number, "ETag": answer["ETag"]}

    def complete_upload(self, key: str, upload_id: str, parts: list[dict[str, Any]]) -> None:
        """The object appears at `key`, whole."""
        self._call(
            "COMPLETE-UPLOAD",
            key,
            lambda: self.client.complete_multipart_upload(
                Bucket=self.bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
            ),
        )

    def abort_upload(self, key: str, upload_id: str) -> None:
        """Drop an upload's parts (gc sweeps what this could not: the caller's own error is what matters)."""
        with contextlib.suppress(Exception):
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)

    def _upload_parts(
        self,
        key: str,
        upload_id: str,
        view: memoryview,
        part: int,
        hasher: Any,
        on_bytes: Callable[[int], None] | None,
    ) -> list[dict[str, Any]]:
        starts = list(range(0, len(view), part))

        def send(number: int, begin: int) -> dict[str, Any]:
            # released on the way out, also when the part fails: the error's traceback keeps this frame, and a
            # live slice would make the caller's `mmap.close()` raise BufferError in place of this error
            with view[begin : begin + part] as piece, ViewReader(piece) as body:
                size = len(piece)
                answer = self._call(
                    "UPLOAD-PART",
                    key,
                    lambda: self.client.upload_part(
                        Bucket=self.bucket,
                        Key=key,
                        UploadId=upload_id,
                        PartNumber=number,
                        Body=body,
                        ContentLength=size,
                    ),
                )
            if on_bytes is not None:
                on_bytes(size)
            return {"PartNumber": number, "ETag": answer["ETag"]}

        workers = max(1, min(self.settings.concurrency, len(starts)))
        with ThreadPoolExecutor(workers, thread_name_prefix="dcs-s3-put") as pool:
            futures = [pool.submit(send, i + 1, begin) for i, begin in enumerate(starts)]
            try:
                for begin in starts:  # hashed here, in order, while the parts travel
                    with view[begin : begin + part] as piece:
                        hasher.update(piece)
                return [f.result() for f in futures]
            finally:
                for f in futures:
                    f.cancel()

    # --- ranged reads ---------------------------------------------------------------------------
    def read_into(self, key: str, begin: int, pieces: list[memoryview]) -> None:
        """Fill `pieces` (in order) with the object's bytes from `begin` on: one ranged GET, read straight into
        them. A short object is CorruptCheckpoint."""
        want = sum(len(p) for p in pieces)
        if want == 0:
            return
        where = f"s3://{self.bucket}/{key}"
        answer = self._call(
            "GET",
            key,
            lambda: self.client.get_object(Bucket=self.bucket, Key=key, Range=f"bytes={begin}-{begin + want - 1}"),
        )
        body = answer["Body"]
        direct = _direct_stream(body)
        done_all = False
        try:
            pos = begin
            for piece in pieces:
                done = 0
                while done < len(piece):
                    with piece[done:] as rest:
                        if direct is not None:
                            n = _read_direct(direct, rest, where)
                        else:
                            n = self._call("GET", key, functools.partial(body.readinto, rest))
                    if not n:
                        raise CorruptCheckpoint(f"{where} ended early at byte {pos + done}", where)
                    done += n
                pos += len(piece)
            done_all = direct is not None and direct.isclosed()
        finally:
            if done_all:
                body._raw_stream.release_conn()  # read to its end (`_direct_stream` checked the attribute)
            else:
                body.close()

    def pool(self) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(max(1, self.settings.read_concurrency), thread_name_prefix="dcs-s3-get")


def _direct_stream(body: Any) -> http.client.HTTPResponse | None:
    """The `http.client` response under botocore's streaming body, when its bytes can be read straight into a
    destination: urllib3's `readinto` reads into a buffer of its own and copies (and http.client's `read(n)`
    copies once more), so a GET read through it costs two copies of every byte; read from here, the socket
    fills the destination. None (read through botocore) when the layers are not what this expects, urllib3
    already buffered some bytes, or the body is content-encoded."""
    raw = getattr(body, "_raw_stream", None)
    fp = getattr(raw, "_fp", None)
    if not isinstance(fp, http.client.HTTPResponse) or not callable(getattr(raw, "release_conn", None)):
        return None
    buffered = getattr(raw, "_decoded_buffer", None)
    if buffered is None or len(buffered) or getattr(raw, "_fp_bytes_read", 1) != 0:
        return None
    if fp.getheader("content-encoding") or fp.isclosed():
        return None
    return fp


def _read_direct(fp: http.client.HTTPResponse, rest: memoryview, where: str) -> int:
    """Bytes of the response read into `rest` (0 at its end); the socket's errors as StorageUnavailable."""
    try:
        return fp.readinto(rest)
    except (OSError, http.client.HTTPException) as exc:
        raise StorageUnavailable(f"GET {where}: {type(exc).__name__}: {_said(exc)}") from None


class NotPublishedObject(Refused):
    """`S3Store.upload`'s publish check said no: the upload was aborted, the key left as it was."""


def wait_all(futures: list[Future[Any]]) -> None:
    """Wait for every future (so no thread still writes into a destination), then raise the first error."""
    first: BaseException | None = None
    for f in futures:
        try:
            f.result()
        except BaseException as exc:
            first = first or exc
    if first is not None:
        raise first
