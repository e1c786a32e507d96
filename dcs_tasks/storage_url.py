"""Where checkpoints live: a storage root named by a URL.

`DCS_CHECKPOINT_DIR` (and `DCS_REPLICA_DIR`) take a bare path or `file://` URL (a POSIX directory: local disk or
a shared file system) or `s3://bucket/prefix` (an S3 or S3-compatible object store). Anything that looks like a
URL and is not exactly one of those two forms is an `InvalidStorageURL`: another scheme (`gs://`), a mistyped one
(`s3:/bucket`, `s3//bucket`, `s3:bucket`, `S3://bucket`, `file:/data`), since read as a path each would quietly
become a local folder and every save would "succeed" there. "Looks like a URL": the value starts with a scheme
and a colon (`name:`), or with a known scheme name followed by `//`. A local folder whose first name holds a
colon is written `./name:x`.

Object keys are checked as hostile input both when a root is configured and when they come back from a listing:
no empty, `.` or `..` component, no backslash or control character, bounded length (S3's own limit is 1024 bytes).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from dcs_tasks.errors import ConfigError, InvalidStorageURL

MAX_KEY_BYTES = 1024  # S3's limit on an object key
BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$", re.ASCII)
SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
SCHEME_COLON = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")  # any `name:` start: a URL, typed right or not
KNOWN_SCHEMES = ("s3", "s3a", "s3n", "file", "gs", "gcs", "az", "abfs", "abfss", "wasb", "hdfs", "http", "https")
MISSING_COLON = re.compile(rf"^({'|'.join(KNOWN_SCHEMES)})//", re.IGNORECASE)  # `s3//bucket`
BAD_KEY_CHARS = re.compile(r"[\x00-\x1f\x7f\\]")


def check_key(key: str, what: str = "object key") -> str:
    """`key` when it is a clean relative key (components separated by `/`), else ValueError naming it."""
    if len(key.encode("utf-8", "surrogatepass")) > MAX_KEY_BYTES:
        raise ValueError(f"{what} {key[:80]!r}... is longer than {MAX_KEY_BYTES} bytes")
    if BAD_KEY_CHARS.search(key):
        raise ValueError(f"{what} {key[:256]!r} holds a control character or a backslash")
    if key and any(part in ("", ".", "..") for part in key.split("/")):
        raise ValueError(f"{what} {key[:256]!r} has an empty, '.' or '..' component")
    return key


@dataclass(frozen=True)
class ObjectURL:
    """`s3://bucket/prefix`: a bucket and a key prefix (no leading or trailing `/`; empty for the bucket root)."""

    bucket: str
    prefix: str = ""
    scheme: str = "s3"

    def __post_init__(self) -> None:
        if self.scheme != "s3":
            raise ConfigError(f"storage URL scheme {self.scheme!r} is not supported: use a path, file:// or s3://")
        if not BUCKET.fullmatch(self.bucket) or ".." in self.bucket:
            raise ConfigError(f"{self.bucket[:80]!r} is not an S3 bucket name (3-63 of a-z, 0-9, '.', '-')")
        try:
            check_key(self.prefix, "storage URL prefix")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    @classmethod
    def parse(cls, url: str) -> ObjectURL:
        """`s3://bucket[/prefix][/]` exactly (lower-case scheme, no empty key component); InvalidStorageURL
        (a ConfigError) otherwise."""
        if not url.startswith("s3://"):
            raise InvalidStorageURL(f"{url[:256]!r} is not an s3:// URL (s3://bucket/prefix)")
        bucket, _, prefix = url[len("s3://") :].partition("/")
        prefix = prefix[:-1] if prefix.endswith("/") else prefix  # one trailing slash is harmless
        try:
            return cls(bucket=bucket, prefix=prefix)
        except ConfigError as exc:
            raise InvalidStorageURL(f"{url[:256]!r}: {exc} (write s3://bucket/prefix)") from None

    def key(self, *parts: str) -> str:
        """The key of `parts` (relative names) under this prefix."""
        return "/".join(p for p in (self.prefix, *parts) if p)

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"


StorageRoot = Path | ObjectURL


def parse_root(value: object) -> StorageRoot:
    """A configured root: an ObjectURL for `s3://`, a Path for a bare path or `file://`; ConfigError otherwise."""
    if isinstance(value, (Path, ObjectURL)):
        return value
    if not isinstance(value, str):
        raise ConfigError(f"a storage root is a path or a URL, not {type(value).__name__}")
    if value.startswith("s3://"):
        return ObjectURL.parse(value)
    if value.startswith("file://"):
        path = value[len("file://") :]
        if not path.startswith("/"):
            raise InvalidStorageURL(f"{value[:256]!r}: a file:// URL names an absolute path (file:///data/ckpt)")
        return Path(path)
    _refuse_url_like(value)
    return Path(value)


def _refuse_url_like(value: str) -> None:
    """InvalidStorageURL when `value`, not an exact `s3://` or `file://` URL, still looks like a URL."""
    shown = value[:256]
    match = SCHEME.match(value)
    if match is not None:
        scheme = match.group(1)
        if scheme.lower() in ("s3", "file"):  # S3://, File://
            raise InvalidStorageURL(f"storage URL {shown!r}: write the scheme in lower case ({scheme.lower()}://)")
        raise InvalidStorageURL(f"storage URL {shown!r}: scheme {scheme!r} is not supported (a path, file:// or s3://)")
    colon = SCHEME_COLON.match(value)
    if colon is not None:  # s3:/bucket, s3:bucket, file:/data
        raise InvalidStorageURL(
            f"storage root {shown!r} looks like a URL but is not one: write s3://bucket/prefix or "
            f"file:///absolute/path (for a local folder whose name holds a colon, write './{shown}')"
        )
    if MISSING_COLON.match(value):  # s3//bucket
        raise InvalidStorageURL(
            f"storage root {shown!r} looks like a URL with its colon missing: write s3://bucket/prefix or "
            f"file:///absolute/path (for a local folder of that name, write './{shown}')"
        )


def is_object_store(root: object) -> bool:
    return isinstance(root, ObjectURL)
