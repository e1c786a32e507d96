"""Where checkpoint bytes live: a POSIX directory (`Path`) or an object store (`ObjectPath`), chosen by URL.

Every I/O on a location goes through its store (`store.Store`: the operations and their call order;
`fs.FileStore`, `objects.ObjectStore`, `memtier.MemoryTierStore`), which `factory.store_of` picks.

`DCS_CHECKPOINT_DIR` / `DCS_REPLICA_DIR` take a bare path, `file:///...` or `s3://bucket/prefix` (`url`). `root`
turns a configured root into the location the checkpoint code joins run and step names onto. S3 access uses
boto3's standard credential chain plus the `s3_*` settings (`dcs_tasks.config`); see docs/checkpoints.md,
"Object storage (S3)".
"""

from __future__ import annotations

from dcs_tasks.storage.factory import Location, open_root, s3_settings, store_of
from dcs_tasks.storage.objpath import ObjectPath
from dcs_tasks.storage.s3 import S3Settings, S3Store
from dcs_tasks.storage.store import Store, Writer
from dcs_tasks.storage_url import ObjectURL, StorageRoot, is_object_store, parse_root

__all__ = [
    "Location",
    "ObjectPath",
    "ObjectURL",
    "S3Settings",
    "S3Store",
    "StorageRoot",
    "Store",
    "Writer",
    "is_object_store",
    "open_root",
    "parse_root",
    "root",
    "s3_settings",
    "store_of",
]

root = open_root
"""The location of a configured root: `factory.open_root` (the name the checkpoint code has always used)."""
