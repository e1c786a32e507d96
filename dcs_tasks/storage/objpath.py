"""`ObjectPath`: a key in an object store, handled where DCS handles a `Path` to a checkpoint file or folder.

A step "directory" on S3 is a key prefix (`<root>/<run>/step-000000042`), its files are objects under it. The
checkpoint code passes step and run locations around opaquely (join a name, take the parent or the name, print
it) and does I/O through the location's store (`factory.store_of`, the one place that looks at the kind). An
`ObjectPath` deliberately has no `__fspath__`: handing one to `open()` or `os.*` fails loudly instead of
creating a local file named `s3:/...`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dcs_tasks.storage.s3 import S3Store
from dcs_tasks.storage_url import check_key


@dataclass(frozen=True)
class ObjectPath:
    store: S3Store = field(compare=False, hash=False, repr=False)
    key: str
    bucket: str = ""

    def __post_init__(self) -> None:
        if not self.bucket:
            object.__setattr__(self, "bucket", self.store.bucket)

    def __truediv__(self, name: str) -> ObjectPath:
        name = str(name)
        check_key(name, "object name")
        return ObjectPath(self.store, f"{self.key}/{name}" if self.key else name)

    @property
    def name(self) -> str:
        return self.key.rpartition("/")[2]

    @property
    def parent(self) -> ObjectPath:
        return ObjectPath(self.store, self.key.rpartition("/")[0])

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.key}"

    def __str__(self) -> str:
        return self.url

    def is_relative_to(self, other: ObjectPath) -> bool:
        return self.bucket == other.bucket and (
            not other.key or self.key == other.key or self.key.startswith(other.key + "/")
        )

    def resolve(self) -> ObjectPath:
        return self  # keys have no links to follow

    # --- I/O -------------------------------------------------------------------------------------
    def size(self) -> int | None:
        """The object's size, None when there is no object under this key."""
        return self.store.head(self.key)

    def exists(self) -> bool:
        """An object at this key, or any object under it (a "directory")."""
        if self.store.head(self.key) is not None:
            return True
        return next(iter(self.store.objects(self.key + "/", limit=1)), None) is not None

    def is_dir(self) -> bool:
        return next(iter(self.store.objects(self.key + "/", limit=1)), None) is not None


MAX_FOLDER_OBJECTS = 100_000  # a step folder listed for sizes holds a step's files: more is not a checkpoint


def listed_sizes(paths: list[ObjectPath]) -> dict[str, int]:
    """Sizes by key of every object in the folders `paths` lie in: one listing per folder instead of a HEAD per
    object (a step's files, and the earlier steps' that its references point into)."""
    sizes: dict[str, int] = {}
    for folder in {(p.bucket, p.parent.key): p for p in paths}.values():
        for item in folder.store.objects(folder.parent.key + "/", limit=MAX_FOLDER_OBJECTS):
            sizes[item.key] = item.size
    return sizes
