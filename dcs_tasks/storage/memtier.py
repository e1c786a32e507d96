"""`MemoryTierStore`: the memory tier's files (a private tmpfs directory, `DCS_MEMORY_DIR`), under a name of its own.

Its files behave as the file store's do (temp name, fsync, rename, directory fsync; symlinks never followed), so
it is the file store rooted at the memory directory, with these differences: it never asks for O_DIRECT (tmpfs
refuses it, or on newer kernels ignores it), it says `in_memory`, and it knows its root, so a location can be
asked whether it is in memory (`holds`). `factory.store_of` hands it every path under a memory directory that
`factory.memory_store` was told of (`memdir.memory_store` does so for the configured one); the file store keeps
every other path. Both are of the "file" family: a path moves between them by file copies and renames.
"""

from __future__ import annotations

from pathlib import Path

from dcs_tasks.storage.fs import FileStore


class MemoryTierStore(FileStore):
    name = "memory"
    direct = False
    in_memory = True

    def __init__(self, root: Path) -> None:
        self.root = root

    def holds(self, loc: object) -> bool:
        """`loc` lies in this memory directory (any location kind may be asked)."""
        return isinstance(loc, Path) and loc.is_relative_to(self.root)
