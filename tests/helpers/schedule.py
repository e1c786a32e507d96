"""How `make test` hands test files to its processes (`--dist loadfile`): longest first, each process given its next
file as soon as it has one test left.

xdist's own file scheduling hands files out by how many tests they hold (most first, `--loadscope-reorder`, its
default), and gives a process its next file while two of its tests are still to run. A file of one long test
(the receiver's fuzzing, the demo) then went out last and ran alone at the end while the other processes idled,
and a process could hold a queued file behind a long last test while another had nothing to do.

Here each unit (a file, or a group of files that must share a process: tests/conftest.py's SHARED_PROCESS) is
weighed by the seconds its files took in a recorded run (`file_seconds.json` beside this module; a file missing
from it weighs the median), and the heaviest go out first: the greedy longest-processing-time order, whose last
file to start is a short one. A process gets its next unit when one test of its current unit is left, the
earliest an xdist worker can take one (it runs a test only once it knows the next, or that there is none).

Regenerate the weights from a full run's JUnit XML (the figures need not be exact; the order is what matters):

    python -m pytest -n 4 --dist loadfile --junitxml=/tmp/junit.xml
    python -m tests.helpers.schedule /tmp/junit.xml
"""

from __future__ import annotations

import collections
import json
import statistics
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import xdist
from xdist.scheduler import LoadFileScheduling

# What `LongestFirst` uses of xdist's scheduling beyond its hook (private; written against pytest-xdist 3.8): the
# methods it overrides or calls, and the attributes an instance has once xdist's __init__ ran.
XDIST_METHODS = ("schedule", "_split_scope", "_reschedule", "_pending_of", "_assign_work_unit")
XDIST_ATTRIBUTES = ("workqueue", "assigned_work")


class SchedulerMismatch(RuntimeError):
    """This pytest-xdist's LoadFileScheduling lacks what `LongestFirst` overrides or calls."""


def check_internals(scheduler: Any, names: tuple[str, ...], version: str = xdist.__version__) -> None:
    """Raise SchedulerMismatch naming each of `names` that `scheduler` (a class or an instance) lacks."""
    missing = [name for name in names if not hasattr(scheduler, name)]
    if missing:
        raise SchedulerMismatch(
            f"pytest-xdist {version}'s LoadFileScheduling has no {', '.join(missing)}, which "
            "tests/helpers/schedule.py's LongestFirst uses (written against pytest-xdist 3.8): update LongestFirst "
            "for this release, or install pytest-xdist 3.8"
        )


SECONDS_FILE = Path(__file__).with_name("file_seconds.json")


def load_seconds(path: Path = SECONDS_FILE) -> dict[str, float]:
    """Test file (relative to the repository, posix) -> seconds in the recorded run; {} when the file is missing or
    unreadable (the order then falls back to collection order)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {str(k): float(v) for k, v in data.items() if isinstance(v, int | float)}


class LongestFirst(LoadFileScheduling):  # type: ignore[misc]  # xdist ships no type hints
    """`--dist loadfile`, the files of a group (`groups`: file -> group name) as one unit, units handed out in
    collection order (`order_items`)."""

    def __init__(self, config: Any, log: Any, groups: Mapping[str, str]) -> None:
        check_internals(LoadFileScheduling, XDIST_METHODS)
        super().__init__(config, log)
        check_internals(self, XDIST_ATTRIBUTES)
        self._groups = dict(groups)

    def _split_scope(self, nodeid: str) -> str:
        file = nodeid.split("::", 1)[0]
        return self._groups.get(file, file)

    def schedule(self) -> None:
        self.config.option.loadscopereorder = False  # collection order (`order_items`), not by number of tests
        super().schedule()

    def _reschedule(self, node: Any) -> None:
        """xdist's, with the next unit sent when one test is left (xdist: two)."""
        if node.shutting_down:
            return
        if not self.workqueue:
            node.shutdown()
            return
        if self._pending_of(self.assigned_work[node]) > 1:
            return
        self._assign_work_unit(node)


def order_items(items: list[Any], root: Path, groups: Mapping[str, str], seconds: Mapping[str, float]) -> None:
    """Sort collected `items` so that units (a file, or the files of one group) come heaviest first; the tests of
    one file keep their order. Every xdist worker collects in this order, and `LongestFirst` keeps it (the
    controller hands out tests by their index in each worker's collection, so the order must be the workers')."""
    default = statistics.median(seconds.values()) if seconds else 0.0

    def file_of(item: Any) -> str:
        try:
            return Path(str(item.path)).relative_to(root).as_posix()
        except ValueError:
            return str(item.path)

    files = dict.fromkeys(file_of(item) for item in items)  # in collection order: ties keep it, in every worker
    weight: dict[str, float] = {}
    for file in files:
        unit = groups.get(file, file)
        weight[unit] = weight.get(unit, 0.0) + seconds.get(file, default)
    first = {unit: i for i, unit in enumerate(weight)}
    rank = {unit: i for i, unit in enumerate(sorted(weight, key=lambda u: (-weight[u], first[u])))}
    items.sort(key=lambda item: rank[groups.get(file_of(item), file_of(item))])  # stable


def seconds_from_junit(xml: Path) -> dict[str, float]:
    """Test file -> the sum of its test cases' times (setup, call and teardown) in a JUnit XML report."""
    import xml.etree.ElementTree as ET

    seconds: collections.Counter[str] = collections.Counter()
    for case in ET.parse(xml).getroot().iter("testcase"):
        parts = case.get("classname", "").split(".")
        module = parts[: next((i for i, p in enumerate(parts) if p.startswith("Test")), len(parts))]
        seconds["/".join(module) + ".py"] += float(case.get("time", 0.0))
    return {f: round(s, 1) for f, s in sorted(seconds.items())}


if __name__ == "__main__":
    SECONDS_FILE.write_text(json.dumps(seconds_from_junit(Path(sys.argv[1])), indent=1) + "\n")
    print(f"wrote {SECONDS_FILE}")
