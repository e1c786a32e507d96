"""`ObjectStore`: checkpoint bytes as objects in S3 (or an S3-compatible server), through `s3.S3Store`.

A "folder" is a key prefix; a write is a multipart upload (one PUT when the object fits in one part) that
becomes visible only when completed, so publish is the complete-upload and abort drops the parts. Parts travel
in parallel (`s3_concurrency` at a time): from a writer's filled part buffers, or for `put` straight from the
caller's buffer (`S3Store.upload`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from dcs_tasks.errors import CorruptCheckpoint, StorageUnavailable
from dcs_tasks.storage.objpath import ObjectPath
from dcs_tasks.storage.s3 import MIN_PART_BYTES, ObjectMissing, S3Store
from dcs_tasks.storage.store import Pieces, Store, Writer


class ObjectWriter(Writer):
    """Regions are gathered into parts of the store's part size; each full part is handed to upload threads as
    it fills, so parts travel side by side while the caller writes the next ones. At most `s3_concurrency` parts
    are in flight (`write` waits for a free slot when they all are), so a writer holds at most that many parts
    plus the one filling in memory. Each part is retried by botocore (`s3_max_attempts`); the first part that
    still fails is raised by the next `write` or by `publish`, and the upload is aborted (parts still travelling
    are waited for first, so none lands after the abort). `publish` is the complete-upload: nothing is visible
    at the key before it."""

    def __init__(self, loc: ObjectPath) -> None:
        self.loc, self.s3 = loc, loc.store
        settings = self.s3.settings
        self.part_bytes = max(MIN_PART_BYTES, settings.part_bytes)
        self.in_flight = max(1, settings.concurrency)
        # a part waits at most as long as botocore may spend on it (every attempt timing out), and some more
        self.wait_seconds = settings.max_attempts * (settings.connect_timeout + settings.read_timeout) + 60.0
        self.slots = threading.BoundedSemaphore(self.in_flight)
        self.pending = bytearray()
        self.upload_id: str | None = None
        self.futures: list[Future[dict[str, Any]]] = []
        self.pool: ThreadPoolExecutor | None = None
        self.closed = False

    def write(self, view: memoryview) -> None:
        assert not self.closed, "write after publish or abort"
        self._raise_failed()
        pos, size = 0, len(view)
        while pos < size:
            take = min(self.part_bytes - len(self.pending), size - pos)
            with view[pos : pos + take] as piece:
                self.pending += piece
            pos += take
            if len(self.pending) == self.part_bytes:
                self._send()

    def _send(self) -> None:
        """Hand the filled part to the upload threads (its bytearray itself: botocore sends one in a single
        `sendall`, where `bytes` would be wrapped in a BytesIO and sent 16 KiB at a time)."""
        if self.upload_id is None:
            self.upload_id = self.s3.start_upload(self.loc.key)
            self.pool = ThreadPoolExecutor(self.in_flight, thread_name_prefix="dcs-s3-part")
        assert self.pool is not None
        data, self.pending = self.pending, bytearray()
        if not self.slots.acquire(timeout=self.wait_seconds):
            raise StorageUnavailable(f"UPLOAD-PART {self.loc}: no part finished within {self.wait_seconds:g} s")
        try:
            self.futures.append(self.pool.submit(self._put, len(self.futures) + 1, data))
        except BaseException:
            self.slots.release()
            raise

    def _put(self, number: int, data: bytearray) -> dict[str, Any]:
        assert self.upload_id is not None
        try:
            return self.s3.put_part(self.loc.key, self.upload_id, number, data)
        finally:
            self.slots.release()

    def _raise_failed(self) -> None:
        for f in self.futures:
            if f.done() and f.exception() is not None:
                raise f.exception()  # type: ignore[misc]

    def publish(self) -> None:
        assert not self.closed, "publish after publish or abort"
        try:
            if self.upload_id is None:
                self.s3.put_small(self.loc.key, self.pending)
            else:
                if self.pending:
                    self._send()
                parts = [f.result(timeout=self.wait_seconds) for f in self.futures]
                self.s3.complete_upload(self.loc.key, self.upload_id, parts)
        except BaseException:
            self.abort()
            raise
        self.published = self.closed = True
        self.pending = bytearray()
        self._stop()

    def abort(self) -> None:
        self.closed = True
        self.pending = bytearray()
        for f in self.futures:
            f.cancel()
        with contextlib.suppress(Exception):
            wait(self.futures, timeout=self.wait_seconds)  # no part may land after the abort
        self._stop()
        if self.upload_id is not None and not self.published:
            self.s3.abort_upload(self.loc.key, self.upload_id)
            self.upload_id = None

    def _stop(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False)
            self.pool = None


class _NoHash:
    def update(self, data: Any) -> None:
        pass


def _prefix(loc: ObjectPath) -> str:
    return loc.key + "/" if loc.key else ""


class ObjectStore(Store[ObjectPath]):
    """Objects under the bucket each `ObjectPath` carries (its `S3Store`)."""

    name = "s3"
    family = "s3"

    def open_writer(self, loc: ObjectPath, tag: str) -> Writer:
        return ObjectWriter(loc)

    def write_small(self, loc: ObjectPath, data: bytes, tag: str) -> None:
        loc.store.put_small(loc.key, data)  # one PUT: whole or not at all

    def put(
        self,
        loc: ObjectPath,
        view: memoryview,
        tag: str,
        *,
        hasher: Any = None,
        publish: Callable[[], bool] | None = None,
        on_bytes: Callable[[int], None] | None = None,
    ) -> None:
        # parallel parts lent straight from `view` (no copy), hashed in order while they travel
        loc.store.upload(loc.key, view, _NoHash() if hasher is None else hasher, publish=publish, on_bytes=on_bytes)

    def stat(self, loc: ObjectPath) -> int | None:
        return loc.size()

    def exists(self, loc: ObjectPath) -> bool:
        return loc.exists()

    def file_exists(self, loc: ObjectPath) -> bool:
        return loc.size() is not None  # a HEAD; `exists` would list the prefix too when there is no object

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
