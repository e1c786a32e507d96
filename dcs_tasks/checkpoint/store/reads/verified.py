"""Verified reads of a step's files wherever they are stored: the one entry point restore, verify and export use.

Callers hand in locations (`Path` or `ObjectPath`, as `FileEntry.stored_path` gives them) and never ask where
the bytes are: the files' store (`dcs_tasks.storage.store_of`, chosen once by the factory) picks its reader from
`READERS`, a table of the stores' verified readers by store name (torchsnapshot's storage plugins are the model):
`fileread` for files (the file store and the memory tier's: chunked O_DIRECT or buffered `preadv`), `objread` for
objects (parallel ranged GETs). Both keep the same contract: every file's size and checksum checked, each byte
landing in its target (`read_scatter`) or in fresh memory (`read_many`), CorruptCheckpoint naming the file that
fails, nothing still being written when a call returns or raises. A store with no reader in the table is a
`StorageError` naming it; a new store adds its reader here, and no caller changes.
"""

from __future__ import annotations

import mmap
from typing import Any, Protocol

from dcs_tasks.checkpoint.format.layout import FileEntry
from dcs_tasks.checkpoint.store.reads import fileread, objread
from dcs_tasks.checkpoint.store.reads.landing import Progress, Target
from dcs_tasks.errors import StorageError
from dcs_tasks.storage import Location, store_of


class VerifiedReader(Protocol):
    """A store's verified reader: `fileread` and `objread` are modules of this shape."""

    def read_many(self, files: Any, verify: bool, progress: Progress | None = None) -> list[mmap.mmap]: ...

    def read_scatter(self, files: Any, verify: bool, progress: Progress | None = None) -> None: ...


READERS: dict[str, VerifiedReader] = {"file": fileread, "memory": fileread, "s3": objread}
"""Store name (`Store.name`) -> its verified reader."""


def reader_of(loc: Location) -> VerifiedReader:
    """The verified reader of `loc`'s store."""
    store = store_of(loc)
    try:
        return READERS[store.name]
    except KeyError:
        raise StorageError(
            f"the {store.name} store has no verified reader (checkpoint/store/reads/verified.py)"
        ) from None


def _by_reader(locs: list[Location]) -> dict[str, list[int]]:
    """Store name -> the indexes of `locs` it holds, in order (a step's files are almost always of one store)."""
    groups: dict[str, list[int]] = {}
    for i, loc in enumerate(locs):
        reader_of(loc)  # a store without a reader fails before anything is read
        groups.setdefault(store_of(loc).name, []).append(i)
    return groups


def read_many(
    files: list[tuple[Location, FileEntry]], verify: bool, progress: Progress | None = None
) -> list[mmap.mmap]:
    """Each file's bytes in its own fresh mapping, in the order given; checked against size and (`verify`)
    checksum."""
    out: list[mmap.mmap | None] = [None] * len(files)
    for name, picks in _by_reader([loc for loc, _ in files]).items():
        mappings = READERS[name].read_many([files[i] for i in picks], verify, progress)
        for i, mapping in zip(picks, mappings, strict=True):
            out[i] = mapping
    return [m for m in out if m is not None]


def read_scatter(
    files: list[tuple[Location, FileEntry, list[Target]]], verify: bool, progress: Progress | None = None
) -> None:
    """Read each file once, each byte landing in its target ((begin, end, writable bytes) ranges of the file,
    disjoint), gaps in scratch; with no targets this only verifies. If a file fails, earlier targets may already
    hold its bytes."""
    for name, picks in _by_reader([loc for loc, _, _ in files]).items():
        READERS[name].read_scatter([files[i] for i in picks], verify, progress)
