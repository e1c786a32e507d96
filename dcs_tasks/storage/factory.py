"""Where a location's store is chosen: the one place that tells a file location from an object location.

A configured root (`DCS_CHECKPOINT_DIR`, `DCS_REPLICA_DIR`: a path, `file://` or `s3://` URL) is parsed once
into a location (`open_root`); everything joined onto it (`/`, `.parent`, `.name`) stays of its kind, and code
that does I/O on it asks `store_of(loc)` for the store (`dcs_tasks/storage/store.py`: the operations and their
call order) instead of switching on the location's type. `tests/unit/test_store_switches.py` fails on an
`isinstance` check on a location type anywhere outside `dcs_tasks/storage/`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from typing_extensions import TypeIs

from dcs_tasks.storage.fs import FileStore
from dcs_tasks.storage.memtier import MemoryTierStore
from dcs_tasks.storage.objects import ObjectStore
from dcs_tasks.storage.objpath import ObjectPath
from dcs_tasks.storage.s3 import S3Settings, S3Store
from dcs_tasks.storage.store import Store
from dcs_tasks.storage_url import ObjectURL, StorageRoot

if TYPE_CHECKING:
    from dcs_tasks.config import DCSConfig

Location = Path | ObjectPath
"""A checkpoint folder or file: a path on a POSIX file system, or a key in an object store."""

FILES = FileStore()
OBJECTS = ObjectStore()
COPY_CHUNK_BYTES = 16 * 1024 * 1024  # one read + write step of `copy`


MAX_MEMORY_ROOTS = 64  # memory directories one process knows (one per configured tier; tests make more)
_memory_stores: dict[Path, MemoryTierStore] = {}


def memory_store(root: Path) -> MemoryTierStore:
    """The memory tier's store for the (resolved) memory directory `root`; from now on `store_of` hands it every
    path under `root`."""
    found = _memory_stores.get(root)
    if found is None:
        if len(_memory_stores) >= MAX_MEMORY_ROOTS:  # the oldest is forgotten: its paths go back to FILES
            del _memory_stores[next(iter(_memory_stores))]
        found = _memory_stores[root] = MemoryTierStore(root)
    return found


def store_of(loc: Location) -> Store[Any]:
    """The store that holds `loc`'s bytes: the memory tier's for a path under a memory directory (`memory_store`),
    the file store for any other path, the object store for an object."""
    if isinstance(loc, ObjectPath):
        return OBJECTS
    if isinstance(loc, Path):
        for root, store in _memory_stores.items():
            if loc.is_relative_to(root):
                return store
        return FILES
    raise TypeError(f"{type(loc).__name__} is not a checkpoint location (a Path or an ObjectPath)")


def s3_settings(config: DCSConfig) -> S3Settings:
    return S3Settings(
        endpoint_url=config.s3.endpoint_url,
        region=config.s3.region,
        addressing_style=config.s3.addressing_style,
        part_bytes=config.s3.part_bytes,
        concurrency=config.s3.concurrency,
        read_concurrency=config.s3.read_concurrency,
        max_attempts=config.s3.max_attempts,
        connect_timeout=config.s3.connect_timeout_seconds,
        read_timeout=config.s3.read_timeout_seconds,
        payload_signing=config.s3.payload_signing,
    )


def open_root(value: StorageRoot, config: DCSConfig) -> Location:
    """The location of a configured root (`config.checkpoint.dir` or `replica_dir`), parsed by `parse_root`."""
    if isinstance(value, ObjectURL):
        return ObjectPath(S3Store(value, s3_settings(config)), value.prefix)
    return Path(value)


def named(text: str, root: Location) -> Location | None:
    """The location `text` names (as `str(loc)` prints one: a task payload's) when it is of `root`'s store: a URL
    `s3://<root's bucket>/<key>` beside an object root, a path beside a file root; None when it is not. Nothing is
    checked, resolved or looked up: `text` is untrusted, its caller checks where the location lies."""
    if isinstance(root, ObjectPath):
        prefix = f"s3://{root.bucket}/"
        return ObjectPath(root.store, text[len(prefix) :]) if text.startswith(prefix) else None
    return None if "://" in text else Path(text)


def same_store(a: Location, b: Location) -> bool:
    """`a` and `b` are locations of one kind of store (a file copy, a server-side copy, `within`, are possible):
    the memory tier's files and other files are one family."""
    return store_of(a).family == store_of(b).family


def within(loc: Location, root: Location) -> bool:
    """`loc` is `root` or lies under it; False when they are of different stores."""
    return same_store(loc, root) and store_of(loc).within(loc, root)


def relative(loc: Location, root: Location) -> str:
    """`loc` below `root` as a relative name (`run/step-...`); ValueError when it is not below it, or the two are
    of different stores."""
    if not same_store(loc, root):
        raise ValueError(f"{loc} and {root} are not the same kind of location")
    return store_of(loc).relative(loc, root)


def is_object(loc: Location) -> TypeIs[ObjectPath]:
    """`loc` is an object in an object store (its bytes are not a local file: no mmap, no flock, no fsync);
    else it is a local path (what the type checker learns from either answer)."""
    return store_of(loc).local_path(loc) is None


def copy(src: Location, dst: Location, tag: str, size: int) -> None:
    """The `size` bytes of `src` as `dst`, through `dst`'s writer (published only when all were read)."""
    buf = bytearray(min(size, COPY_CHUNK_BYTES))
    view = memoryview(buf)
    source, target = store_of(src), store_of(dst)
    with target.open_writer(dst, tag) as writer:
        for pos in range(0, size, len(buf) or 1):
            with view[: min(len(buf), size - pos)] as piece:
                source.read_into(src, pos, [piece])
                writer.write(piece)
        writer.publish()
