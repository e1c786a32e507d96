"""`Store`: the operations DCS does on checkpoint bytes, one implementation per place the bytes live.

Modelled on torch DCP's `FileSystem` interface and torchsnapshot's storage plugins: a handful of operations with
a fixed call order, and everything above them written once. The implementations: `fs.FileStore` (a POSIX
directory: O_DIRECT writes, fsync, rename, directory fsync), `objects.ObjectStore` (S3 and S3-compatible servers:
multipart uploads, ranged GETs) and `memtier.MemoryTierStore` (files in the memory tier's tmpfs directory). A
location (`Path` or `ObjectPath`) is handed to its store by `factory.store_of`, the one place that tells them
apart; a configured root is parsed once, by `factory.open_root`.

Call order of a write (a step's file, a replica's copy, a manifest):

1. `open_writer(loc, tag)`: a private staging copy (a temp file beside `loc`, or a multipart upload); parents
   are made as needed. Nothing is visible at `loc`.
2. `Writer.write(view)`, any number of times: the next region of the bytes, in order.
3. `Writer.publish()`: the bytes made durable and visible at `loc` whole, at once (fsync, atomic rename,
   directory fsync; or complete-upload). Or `Writer.abort()` (also what leaving the writer's `with` block
   unpublished does): the staging copy goes, `loc` stays as it was.

A whole buffer already in memory (a staging mapping, a compressed memfd) is stored in one call instead:
`put(loc, view, tag, hasher=, publish=, on_bytes=)` (the same staging, publish or abort, but the store lends the
caller's buffer to the I/O: parallel multipart parts, O_DIRECT writes; hashed in order on the way; `publish` is
asked once every byte is stored, just before they become visible, and False raises `Refused`, leaving `loc` as
it was).

Locks: `lock(folder, name, shared=, fence=)` holds the folder's lock `name` (`latest`: the read-compare-write of
a run's pointer; `refs`: references against retention) for a `with` block: an `flock` on `<folder>/.<name>.lock`
on files; a store with no locks of its own (an object store) takes `fence(folder, name)`, the caller's lock held
elsewhere (Redis), and refuses without one.

Reads: `stat(loc)` (the size of a regular file or object, None when there is none), `exists`, `names` (the names
directly under a folder), `files` (every file under a folder with its size, one listing), `read_into` (a range
into the caller's buffers), `read_small` (a whole small file: a manifest, a pointer). Deletes: `delete` (files or
objects, missing ones ignored; a folder raises) and `delete_tree` (a folder and everything under it).
`local_path` says whether the bytes are a local file (mmap, O_DIRECT, locks) and where.
"""

from __future__ import annotations

import abc
import types
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Generic, TypeVar

from dcs_tasks.errors import StorageError

L = TypeVar("L")
MAX_FILES = 1_000_000  # a folder listing longer than this is refused (a hostile or runaway tree)
Pieces = list[memoryview]  # the caller's buffers, filled in order
Fence = Callable[[Any, str], AbstractContextManager[None]]  # (folder, lock name) -> a lock held elsewhere (Redis)


class Refused(StorageError):
    """`Store.put`'s publish check said no: nothing was published, the location stays as it was."""


class NoLock(StorageError):
    """`Store.lock` on a store with no locks of its own, and no fence given (an object store has no flock)."""


class Writer(abc.ABC):
    """One file or object being written (`Store.open_writer`): regions in order, then `publish` or `abort`."""

    published = False

    @abc.abstractmethod
    def write(self, view: memoryview) -> None:
        """Append `view` (the next region of the bytes)."""

    @abc.abstractmethod
    def publish(self) -> None:
        """Make the bytes durable and visible at the writer's location, whole and at once."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Drop the staging copy; the location stays as it was. Safe to call twice, or after a failed publish."""

    def __enter__(self) -> Writer:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: types.TracebackType | None
    ) -> None:
        if not self.published:
            self.abort()


class Store(abc.ABC, Generic[L]):
    """Where checkpoint bytes live. Locations are the store's own kind (`Path` for files, `ObjectPath` for objects);
    a "folder" is a directory, or a key prefix in an object store."""

    name: str = "store"
    family: str = "store"  # stores of one family share a location kind: `within`, `relative`, file copies
    in_memory = False  # the memory tier's (its bytes are in RAM: recycled pages, sealed steps)

    # --- writing ---------------------------------------------------------------------------------
    @abc.abstractmethod
    def open_writer(self, loc: L, tag: str) -> Writer:
        """A writer of `loc` (see the module docstring for the order). `tag` names the writer in temp names."""

    def make_folder(self, loc: L) -> None:
        """Make the folder `loc` (and its parents) durably, so a later write or publish finds it; nothing to do
        in an object store, whose folders are key prefixes."""

    def write_small(self, loc: L, data: bytes, tag: str) -> None:
        """`data` as the whole of `loc`, durably and atomically (a manifest, a marker, a pointer)."""
        with self.open_writer(loc, tag) as writer:
            writer.write(memoryview(data))
            writer.publish()

    @abc.abstractmethod
    def put(
        self,
        loc: L,
        view: memoryview,
        tag: str,
        *,
        hasher: Any = None,
        publish: Callable[[], bool] | None = None,
        on_bytes: Callable[[int], None] | None = None,
    ) -> None:
        """The whole of `view` as `loc`, durably and atomically (`view` stays the caller's, unchanged, until this
        returns). `hasher`: updated with the bytes in order. `publish`: asked once every byte is stored, just
        before they become visible; False raises `Refused` and nothing is published. `on_bytes(n)`: called as
        bytes are stored (a pacer)."""

    def lock(
        self, folder: L, name: str, *, shared: bool = False, fence: Fence | None = None
    ) -> AbstractContextManager[None]:
        """The folder's lock `name`, held for a `with` block (shared or exclusive). A store with no locks of its
        own takes `fence(folder, name)` (exclusive either way) and raises `NoLock` without one."""
        if fence is None:
            raise NoLock(f"{self.name} store has no locks of its own: locking {folder} ({name}) needs a fence")
        return fence(folder, name)

    # --- reading ---------------------------------------------------------------------------------
    @abc.abstractmethod
    def stat(self, loc: L) -> int | None:
        """The size of the regular file (never a symlink) or object at `loc`; None when there is none."""

    @abc.abstractmethod
    def exists(self, loc: L) -> bool:
        """A file, object or non-empty folder at `loc` (a symlink counts as there, never followed)."""

    def file_exists(self, loc: L) -> bool:
        """`exists` for a name only a file or object holds (a step's manifest, a marker): as `exists` here; an
        object store asks for the object alone (one HEAD, no listing of a folder of that name)."""
        return self.exists(loc)

    @abc.abstractmethod
    def names(self, loc: L) -> list[str]:
        """The names directly under the folder `loc` (files and folders; symlinks are left out), sorted."""

    @abc.abstractmethod
    def folders_with(self, loc: L, name: str) -> list[str]:
        """The names of the folders directly under `loc` that hold an entry `name` (the steps of a run holding a
        manifest), sorted: one listing in an object store. Symlinked folders are left out."""

    @abc.abstractmethod
    def files(self, loc: L, limit: int) -> dict[str, int]:
        """Every regular file under the folder `loc`, as its `/`-joined name relative to `loc` -> its size; at most
        `limit` (more is a StorageError). Symlinks are neither followed nor listed."""

    @abc.abstractmethod
    def read_into(self, loc: L, offset: int, pieces: Pieces) -> None:
        """Fill `pieces`, in order, with the bytes of `loc` from `offset` on. CorruptCheckpoint when it is
        missing, not a regular file, or ends first."""

    @abc.abstractmethod
    def read_small(self, loc: L, limit: int) -> bytes:
        """The whole of `loc` when it holds at most `limit` bytes; CorruptCheckpoint when it is missing, not a
        regular file (a symlink is never followed), larger, or unreadable."""

    # --- deleting --------------------------------------------------------------------------------
    @abc.abstractmethod
    def delete(self, locs: Sequence[L]) -> None:
        """Remove the files or objects `locs` (missing ones are no error), durably."""

    @abc.abstractmethod
    def delete_tree(self, loc: L, keep: frozenset[str] = frozenset()) -> None:
        """Remove the folder `loc` and everything under it (a missing one is no error); with `keep`, everything
        but the entries directly under `loc` of those names (the folder stays), durably."""

    # --- what the bytes are ----------------------------------------------------------------------
    def local_path(self, loc: L) -> Path | None:
        """The local file system path of `loc` when its bytes are a local file (mmap, O_DIRECT, flock work on
        it), else None."""
        return None

    def resolve(self, loc: L) -> L:
        """`loc` with every symlink resolved (UntrustedPath when that fails); object keys are returned as they are."""
        return loc

    @abc.abstractmethod
    def within(self, loc: L, root: L) -> bool:
        """`loc` is `root` or lies under it (both of this store)."""

    @abc.abstractmethod
    def relative(self, loc: L, root: L) -> str:
        """`loc` below `root` as a `/`-joined relative name; ValueError when it is not strictly below it."""

    @abc.abstractmethod
    def sweep(self, loc: L) -> None:
        """Drop what unpublished writes left directly in the folder `loc` (temp files, open multipart uploads):
        called once every file the folder should hold is published."""
