"""Where checkpoint bytes live: a POSIX directory (`Path`) or an object store (`ObjectPath`), chosen by URL.

`DCS_CHECKPOINT_DIR` / `DCS_REPLICA_DIR` take a bare path, `file:///...` or `s3://bucket/prefix` (`url`). `root`
turns a configured root into the location the checkpoint code joins run and step names onto. S3 access uses
boto3's standard credential chain plus the `s3_*` settings (`dcs_tasks.config`); see docs/checkpoints.md,
"Object storage (S3)".
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from dcs_tasks.storage.objpath import ObjectPath
from dcs_tasks.storage.s3 import S3Settings, S3Store
from dcs_tasks.storage_url import ObjectURL, StorageRoot, is_object_store, parse_root

if TYPE_CHECKING:
    from dcs_tasks.config import DCSConfig

Location = Path | ObjectPath
"""A checkpoint folder or file: a path on a POSIX file system, or a key in an object store."""

__all__ = [
    "Location",
    "ObjectPath",
    "ObjectURL",
    "S3Settings",
    "S3Store",
    "StorageRoot",
    "is_object_store",
    "parse_root",
    "root",
    "s3_settings",
]


def s3_settings(config: DCSConfig) -> S3Settings:
    return S3Settings(
        endpoint_url=config.s3_endpoint_url,
        region=config.s3_region,
        addressing_style=config.s3_addressing_style,
        part_bytes=config.s3_part_bytes,
        concurrency=config.s3_concurrency,
        read_concurrency=config.s3_read_concurrency,
        max_attempts=config.s3_max_attempts,
        connect_timeout=config.s3_connect_timeout_seconds,
        read_timeout=config.s3_read_timeout_seconds,
    )


def root(value: StorageRoot, config: DCSConfig) -> Location:
    """The location of a configured root (`config.checkpoint_dir` or `replica_dir`)."""
    if isinstance(value, ObjectURL):
        return ObjectPath(S3Store(value, s3_settings(config)), value.prefix)
    return Path(value)
