"""Where checkpoints live: a storage root named by a URL.

`DCS_CHECKPOINT_DIR` (and `DCS_REPLICA_DIR`) take a bare path or `file://` URL (a POSIX directory: local disk or
a shared file system) or `s3://bucket/prefix` (an S3 or S3-compatible object store). Any other scheme is a
`ConfigError`: before this module, `s3://b/p` was read as the relative folder `s3:/b/p` and a user got local
files and no error.

Object keys are checked as hostile input both when a root is configured and when they come back from a listing:
no empty, `.` or `..` component, no backslash or control character, bounded length (S3's own limit is 1024 bytes).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from dcs_tasks.errors import ConfigError

MAX_KEY_BYTES = 1024  # S3's limit on an object key
BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$", re.ASCII)
SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
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
        match = SCHEME.match(url)
        if match is None or match.group(1).lower() != "s3":
            raise ConfigError(f"{url[:256]!r} is not an s3:// URL")
        rest = url[match.end() :]
        bucket, _, prefix = rest.partition("/")
        return cls(bucket=bucket, prefix=prefix.strip("/"))

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
    match = SCHEME.match(value)
    if match is None:
        return Path(value)
    scheme = match.group(1).lower()
    if scheme == "file":
        path = value[match.end() :]
        if not path.startswith("/"):
            raise ConfigError(f"{value[:256]!r}: a file:// URL names an absolute path (file:///data/ckpt)")
        return Path(path)
    if scheme == "s3":
        return ObjectURL.parse(value)
    raise ConfigError(f"storage URL {value[:256]!r}: scheme {scheme!r} is not supported (a path, file:// or s3://)")


def is_object_store(root: object) -> bool:
    return isinstance(root, ObjectURL)
