"""`ObjectStore`: checkpoint bytes as objects in S3 (or an S3-compatible server), through `s3.S3Store`.

A "folder" is a key prefix; a write is a multipart upload (one PUT when the object fits in one part) that
becomes visible only when completed, so publish is the complete-upload and abort drops the parts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dcs_tasks.errors import CorruptCheckpoint
from dcs_tasks.storage.objpath import ObjectPath
from dcs_tasks.storage.s3 import MIN_PART_BYTES, ObjectMissing, S3Store
from dcs_tasks.storage.store import Pieces, Store, Writer


class ObjectWriter(Writer):
    """Regions are gathered into parts of the store's part size; each full part is uploaded as it fills."""

    def __init__(self, loc: ObjectPath) -> None:
        self.loc, self.s3 = loc, loc.store
        self.part_bytes = max(MIN_PART_BYTES, self.s3.settings.part_bytes)
        self.pending = bytearray()
        self.upload_id: str | None = None
        self.parts: list[dict[str, Any]] = []
        self.closed = False

    def write(self, view: memoryview) -> None:
        assert not self.closed, "write after publish or abort"
        self.pending += view
        while len(self.pending) >= self.part_bytes:
            self._send(bytes(self.pending[: self.part_bytes]))
            del self.pending[: self.part_bytes]

    def _send(self, data: bytes) -> None:
        if self.upload_id is None:
            self.upload_id = self.s3.start_upload(self.loc.key)
        self.parts.append(self.s3.put_part(self.loc.key, self.upload_id, len(self.parts) + 1, data))

    def publish(self) -> None:
        assert not self.closed, "publish after publish or abort"
        try:
            if self.upload_id is None:
                self.s3.put_small(self.loc.key, bytes(self.pending))
            else:
                if self.pending:
                    self._send(bytes(self.pending))
                self.s3.complete_upload(self.loc.key, self.upload_id, self.parts)
        except BaseException:
            self.abort()
            raise
        self.published = self.closed = True
        self.pending = bytearray()

    def abort(self) -> None:
        self.closed = True
        self.pending = bytearray()
        if self.upload_id is not None and not self.published:
            self.s3.abort_upload(self.loc.key, self.upload_id)
            self.upload_id = None


def _prefix(loc: ObjectPath) -> str:
    return loc.key + "/" if loc.key else ""


class ObjectStore(Store[ObjectPath]):
    """Objects under the bucket each `ObjectPath` carries (its `S3Store`)."""

    name = "s3"

    def open_writer(self, loc: ObjectPath, tag: str) -> Writer:
        return ObjectWriter(loc)

    def write_small(self, loc: ObjectPath, data: bytes, tag: str) -> None:
        loc.store.put_small(loc.key, data)  # one PUT: whole or not at all

    def stat(self, loc: ObjectPath) -> int | None:
        return loc.size()

    def exists(self, loc: ObjectPath) -> bool:
        return loc.exists()

    def names(self, loc: ObjectPath) -> list[str]:
        prefix = _prefix(loc)
        names = {item.key[len(prefix) :].split("/", 1)[0] for item in loc.store.objects(prefix)}
        return sorted(names)

    def folders_with(self, loc: ObjectPath, name: str) -> list[str]:
        prefix, found = _prefix(loc), set()
        for item in loc.store.objects(prefix):
            parts = item.key[len(prefix) :].split("/")
            if len(parts) == 2 and parts[1] == name:
                found.add(parts[0])
        return sorted(found)

    def files(self, loc: ObjectPath, limit: int) -> dict[str, int]:
        prefix = _prefix(loc)
        return {item.key[len(prefix) :]: item.size for item in loc.store.objects(prefix, limit=limit)}

    def read_into(self, loc: ObjectPath, offset: int, pieces: Pieces) -> None:
        try:
            loc.store.read_into(loc.key, offset, pieces)
        except ObjectMissing as exc:
            raise CorruptCheckpoint(f"checkpoint object {loc} is missing", str(loc)) from exc

    def read_small(self, loc: ObjectPath, limit: int) -> bytes:
        try:
            return loc.store.get_small(loc.key, limit)
        except ObjectMissing as exc:
            raise CorruptCheckpoint(f"checkpoint object {loc} is missing", str(loc)) from exc

    def delete(self, locs: Sequence[ObjectPath]) -> None:
        by_store: dict[int, tuple[S3Store, list[str]]] = {}
        for loc in locs:
            by_store.setdefault(id(loc.store), (loc.store, []))[1].append(loc.key)
        for s3, keys in by_store.values():
            s3.delete(keys)

    def delete_tree(self, loc: ObjectPath, keep: frozenset[str] = frozenset()) -> None:
        base = _prefix(loc)
        keys = [i.key for i in loc.store.objects(base) if i.key[len(base) :].split("/", 1)[0] not in keep]
        if keys:
            loc.store.delete(keys)

    def within(self, loc: ObjectPath, root: ObjectPath) -> bool:
        return loc.is_relative_to(root)

    def relative(self, loc: ObjectPath, root: ObjectPath) -> str:
        if not loc.is_relative_to(root) or loc == root:
            raise ValueError(f"{loc} is not under {root}")
        return loc.key[len(root.key) :].lstrip("/")

    def sweep(self, loc: ObjectPath) -> None:
        loc.store.abort_uploads(_prefix(loc))
