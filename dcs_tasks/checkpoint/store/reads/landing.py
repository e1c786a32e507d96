"""Where verified reads land: the destination types and fresh memory shared by every reader of checkpoint
files (`fileread` for files, `zread` for compressed files, `objread` for objects).

`Target`: (begin, end) of a file and the writable bytes its range lands in; `TargetIndex`: one file's targets,
sorted, cut into destination slices per chunk; `anonymous`: fresh private memory (huge pages for large files).
"""

from __future__ import annotations

import bisect
import mmap
from collections.abc import Callable, Iterator

Progress = Callable[[str, int, int], None]  # (file name, bytes done, file size)
Target = tuple[int, int, memoryview]  # (begin, end) inside the file, writable bytes of the destination
HUGE_PAGE = 2 * 1024 * 1024
HUGE_FROM = 8 * 1024 * 1024  # smaller files get plain pages (a 2 MiB page for a few KiB is waste)


def anonymous(nbytes: int, huge_pages: bool = True) -> mmap.mmap:
    """Fresh private memory of at least `nbytes` (page-rounded). From `HUGE_FROM` bytes on, unless
    `huge_pages` is False, it is backed by transparent huge pages where the kernel allows it (the length is
    rounded to 2 MiB so the kernel aligns the mapping for them): a fault then zeroes 2 MiB at once, ~2x
    cheaper per byte than 4 KiB pages when the kernel has free huge pages at hand, but up to ~4x dearer when
    it must first find them (on the development VM 1 GiB faulted in anywhere from 0.19 to 1.9 s with huge
    pages, against a steady 0.47-0.51 s with plain ones)."""
    huge = huge_pages and nbytes >= HUGE_FROM and hasattr(mmap, "MADV_HUGEPAGE")
    unit = HUGE_PAGE if huge else mmap.PAGESIZE
    mapping = mmap.mmap(-1, max(unit, -(-nbytes // unit) * unit), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge:
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass  # THP disabled: plain pages, just slower to fault in
    return mapping


class TargetIndex:
    """The targets of one file (disjoint), sorted by begin."""

    def __init__(self, targets: list[Target]) -> None:
        self.targets = sorted(targets, key=lambda t: t[0])
        self._ends = [end for _, end, _ in self.targets]

    def overlapping(self, begin: int, end: int) -> Iterator[Target]:
        """The targets that overlap [begin, end), in order (a bisection, not a scan of every target)."""
        for i in range(bisect.bisect_right(self._ends, begin), len(self.targets)):
            target = self.targets[i]
            if target[0] >= end:
                return
            yield target

    def pieces(self, scratch: memoryview, begin: int, end: int) -> list[memoryview]:
        """[begin, end) of the file as destination slices in file order: the targets' own bytes where they
        overlap it, `scratch` (indexed from `begin`) for the gaps (header, padding)."""
        out: list[memoryview] = []
        pos = begin
        for t_begin, t_end, dest in self.overlapping(begin, end):
            lo, hi = max(begin, t_begin), min(end, t_end)
            if lo > pos:
                out.append(scratch[pos - begin : lo - begin])
            out.append(dest[lo - t_begin : hi - t_begin])
            pos = hi
        if pos < end:
            out.append(scratch[pos - begin : end - begin])
        return out
