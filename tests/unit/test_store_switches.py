"""Where bytes live is chosen in one place: `dcs_tasks/storage/` (the factory, `factory.store_of`, and the stores).

Code elsewhere asks a location's store (`store_of(loc).stat(loc)`, `factory.within`, `factory.is_object`) instead
of switching on the location's type, so a new place for bytes is one new store, not a new branch in every caller.
This scan (with `ast`, nothing imported) fails on any `isinstance(x, T)`, `issubclass` or `type(x) is T` check whose
T names a location type (`Path`, `PurePath`, `PosixPath`, `ObjectPath`, `Location`) in product code outside
`dcs_tasks/storage/`, and names the file and line.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.unit.importgraph import ROOT, files_of

LOCATION_TYPES = frozenset({"Path", "PurePath", "PosixPath", "PurePosixPath", "ObjectPath", "Location"})
FACTORY = ROOT / "dcs_tasks" / "storage"
# The configured-root parser checks config values (a str, a Path or an ObjectURL), before any location exists.
PARSERS = {ROOT / "dcs_tasks" / "storage_url.py"}


def _names(node: ast.AST) -> set[str]:
    """The type names a check's second argument mentions (`Path`, `storage.ObjectPath`, `(A, B)`, `A | B`)."""
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
    }


def switches_in(source: str) -> list[tuple[int, str]]:
    """(line, source text) of every type check on a location type in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        checked: ast.AST | None = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) == 2:
            if node.func.id in ("isinstance", "issubclass"):
                checked = node.args[1]
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot, ast.Eq)) for op in node.ops):
            left = node.left
            if isinstance(left, ast.Call) and isinstance(left.func, ast.Name) and left.func.id == "type":
                checked = ast.Tuple(elts=list(node.comparators), ctx=ast.Load())
        if checked is not None and _names(checked) & LOCATION_TYPES:
            found.append((node.lineno, ast.get_source_segment(source, node) or ""))
    return found


def location_switches() -> list[str]:
    wrong = []
    for path in files_of("dcs_tasks", "coordinator", "workers"):
        if path.is_relative_to(FACTORY) or path in PARSERS:
            continue
        for line, text in switches_in(path.read_text()):
            wrong.append(f"{path.relative_to(ROOT)}:{line}: {text}")
    return wrong


def test_no_location_type_switch_outside_the_storage_factory() -> None:
    wrong = location_switches()
    assert wrong == [], (
        "ask the location's store (dcs_tasks.storage.store_of, factory.within/is_object) instead of checking its "
        "type:\n" + "\n".join(wrong)
    )


def test_the_scan_sees_every_form_of_a_switch() -> None:
    source = (
        "isinstance(a, ObjectPath)\nisinstance(a, (Path, str))\nisinstance(a, storage.ObjectPath)\n"
        "type(a) is Path\nisinstance(a, int)\nisinstance(a, Path | ObjectPath)\n"
    )
    assert [line for line, _ in switches_in(source)] == [1, 2, 3, 4, 6]


def test_the_factory_is_where_the_store_is_chosen() -> None:
    assert switches_in((FACTORY / "factory.py").read_text()), "store_of switches on the location's type"
    assert Path(__file__).name == "test_store_switches.py"


# `factory.is_object` branches still outside the factory (file -> calls, when they were counted): none. A place
# that picks a code path by where the bytes live asks its store for an operation instead (`Store.put`,
# `Store.lock`, `Store.files` + `Store.read_into` for a step's headers, the verified reader its store picks:
# `store/reads/verified.py`, ...). What needs a local file's descriptor, mapping or flock asks the interface's
# capability query, `Store.local_path` (None: the store lends no local file), as torch DCP's readers ask for a
# path. The count only goes down.
IS_OBJECT_LEFT: dict[str, int] = {}


def is_object_calls() -> dict[str, int]:
    """File -> how many calls of `is_object` it makes (product code outside `dcs_tasks/storage/`)."""
    found: dict[str, int] = {}
    for path in files_of("dcs_tasks", "coordinator", "workers"):
        if path.is_relative_to(FACTORY):
            continue
        calls = [
            node
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call)
            and (getattr(node.func, "id", None) == "is_object" or getattr(node.func, "attr", None) == "is_object")
        ]
        if calls:
            found[path.relative_to(ROOT).as_posix()] = len(calls)
    return found


def test_location_branches_outside_the_factory_only_go_down() -> None:
    found = is_object_calls()  # a module that moves keeps its count: only the total is held
    assert sum(found.values()) <= sum(IS_OBJECT_LEFT.values()), (
        f"{sum(found.values())} is_object branches, at most {sum(IS_OBJECT_LEFT.values())} allowed (add the "
        f"operation to the Store interface instead): {found}"
    )
