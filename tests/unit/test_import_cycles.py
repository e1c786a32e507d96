"""No import cycles in product code, and the format and store stages of checkpoints
(the folders dcs_tasks/checkpoint/format/ and store/) import no torch.

The graph has one node per module of `dcs_tasks`, `coordinator`, `workers` and `bench`, and an edge for every
import statement (module level, inside a function, under `TYPE_CHECKING`, `importlib.import_module` with a
literal: see importgraph.py). `from pkg import name` is an edge to pkg.name when that is a module, else to
pkg itself: importing a package runs its `__init__`, so a re-export there counts like any import. Importing
`a.b.c` also runs `a` and `a.b` first, but that is not counted as an edge to them: a submodule never needs its
parent `__init__` for anything but re-exports, and reaches a sibling by importing the sibling itself.

A failure names each cycle as `a -> b -> c -> a`, with the file and line of every edge.
"""

from __future__ import annotations

import itertools
import re
from collections import deque
from collections.abc import Iterable, Mapping

from tests.unit.importgraph import ROOT, files_of, imports_of, is_module, module_name, path_of, where

TOPS = ("dcs_tasks", "coordinator", "workers", "bench")

# The stages of dcs_tasks/checkpoint/ (docs/architecture.md, "Checkpoint stages"), in order. A module's stage is
# its folder, dcs_tasks/checkpoint/<stage>/; the modules directly in dcs_tasks/checkpoint/ (the package
# `__init__`, `Checkpointer` and the rest of the API) are the last stage, "api". A module imports only modules
# of its own stage and of earlier ones (cycles inside a stage are caught above).
CHECKPOINT = "dcs_tasks.checkpoint"
CHECKPOINT_DIR = ROOT / "dcs_tasks" / "checkpoint"
API = "api"
STAGE_ORDER = ("format", "state", "store", "save", "restore", API)


def checkpoint_stages() -> dict[str, tuple[str, ...]]:
    """stage -> its modules (dotted, a stage's own `__init__` included), read from the folders. A folder that
    is not a stage keeps its own name (test_the_checkpoint_folders_are_the_stages fails on it)."""
    stages: dict[str, list[str]] = {}
    for path in files_of("dcs_tasks/checkpoint"):
        parts = path.relative_to(CHECKPOINT_DIR).parts
        stages.setdefault(API if len(parts) == 1 else parts[0], []).append(module_name(path))
    return {stage: tuple(sorted(names)) for stage, names in stages.items()}


STAGES = checkpoint_stages()

# The format/ and store/ folders, with everything under dcs_tasks/storage/ and everything they import inside
# dcs_tasks, import no torch in any form (module level, lazily, under TYPE_CHECKING): a worker moves bytes.
TORCH_FREE = tuple(name for stage in ("format", "store") for name in STAGES.get(stage, ()))
TORCH_FREE_PACKAGES = ("dcs_tasks/storage",)

# Modules the torch-free stages reach that do import torch, each with the reason it is tolerated. Their own
# imports are still followed (what they import must be torch-free).
TORCH_EXCEPTIONS: dict[str, str] = {
    "dcs_tasks.tensors": (
        "the one dtype table shared with weight sync (base layer): the format stage uses its torch-free part "
        "(safetensors codes, item sizes, TensorSpec's name/code/shape); torch is imported only inside "
        "`_torch_dtypes()`, on first use of a torch dtype, and for type hints. test_worker_imports proves a "
        "worker never triggers it."
    ),
}


def _target(name: str) -> str | None:
    """The repository module an import of `name` runs last (the longest prefix that is a module), or None."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if is_module(candidate):
            return candidate
    return None


def import_graph(tops: Iterable[str] = TOPS) -> dict[str, dict[str, list[str]]]:
    """module -> {imported module -> [file:line of each import statement]}, within `tops`."""
    graph: dict[str, dict[str, list[str]]] = {}
    for path in files_of(*tops):
        edges = graph.setdefault(module_name(path), {})
        for line, name in imports_of(path):
            target = _target(name)
            if target is None or target.split(".")[0] not in tops or target == module_name(path):
                continue
            edges.setdefault(target, []).append(where(path, line))
    return graph


def _components(graph: Mapping[str, Mapping[str, object]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, {}))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, {})))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _path(graph: Mapping[str, Mapping[str, object]], start: str, goal: str, within: set[str]) -> list[str]:
    """A shortest import path start -> ... -> goal through modules of `within` (one exists: same component)."""
    parents: dict[str, str | None] = {start: None}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        if node == goal:
            break
        for child in sorted(graph.get(node, {})):
            if child in within and child not in parents:
                parents[child] = node
                queue.append(child)
    path = [goal]
    while (parent := parents[path[-1]]) is not None:
        path.append(parent)
    return path[::-1]


def cycles(graph: Mapping[str, Mapping[str, object]]) -> list[list[str]]:
    """Import cycles [a, b, ..., a]: for every edge inside a strongly connected component, the shortest cycle
    through it (so every edge that takes part in a cycle is named), each cycle once."""
    out: dict[tuple[str, ...], list[str]] = {}
    for component in _components(graph):
        members = set(component)
        for node in component:
            for child in sorted(graph[node]):
                if child in members:
                    loop = [node, *_path(graph, child, node, members)]
                    ring = loop[:-1]
                    first = ring.index(min(ring))
                    key = tuple(ring[first:] + ring[:first])
                    out.setdefault(key, [*key, key[0]])
    return sorted(out.values())


def describe(graph: Mapping[str, Mapping[str, list[str]]], loop: list[str]) -> str:
    edges = "".join(f"\n    {a} -> {b}: {', '.join(graph[a][b])}" for a, b in itertools.pairwise(loop))
    return " -> ".join(loop) + edges


def test_product_code_has_no_import_cycles() -> None:
    graph = import_graph()
    found = [describe(graph, loop) for loop in cycles(graph)]
    assert found == [], "import cycles (move the shared piece to a module both can import):\n" + "\n".join(found)


def test_the_checkpoint_folders_are_the_stages() -> None:
    folders = sorted(stage for stage in STAGES if stage != API)
    strays = [folder for folder in folders if folder not in STAGE_ORDER]
    assert strays == [], f"folders of dcs_tasks/checkpoint/ that are not stages {STAGE_ORDER}: {strays}"
    missing = [s for s in STAGE_ORDER if s != API and not (CHECKPOINT_DIR / s / "__init__.py").is_file()]
    assert missing == [], f"stage folders without an __init__.py: {missing}"
    # A stage package's __init__, and that of every package inside a stage (store/ledger/, ...), holds a docstring
    # only: a re-export is an import edge (and runs the stage's modules whenever any one of them is imported, torch
    # included).
    wrong = [
        where(path, line)
        for stage in STAGE_ORDER
        if stage != API
        for path in sorted((CHECKPOINT_DIR / stage).rglob("__init__.py"))
        for line, name in imports_of(path)
        if name != "__future__"
    ]
    assert wrong == [], f"imports in a stage package's __init__.py (keep it a docstring): {wrong}"


def test_checkpoint_modules_import_only_their_own_and_earlier_stages() -> None:
    order = {
        module: STAGE_ORDER.index(stage) for stage, names in STAGES.items() if stage in STAGE_ORDER for module in names
    }
    graph = import_graph(("dcs_tasks",))
    wrong = [
        f"{', '.join(places)}: {module} ({STAGE_ORDER[order[module]]}) imports {target} "
        f"({STAGE_ORDER[order[target]]}, a later stage)"
        for module in sorted(order)
        for target, places in sorted(graph[module].items())
        if target in order and order[target] > order[module]
    ]
    assert wrong == [], "checkpoint imports against the stage order:\n" + "\n".join(wrong)


def test_the_stage_table_of_the_docs_lists_the_folders() -> None:
    """docs/architecture.md's table ("Checkpoint stages") names each stage's modules as its folder holds them, a
    module of a package inside the stage folder as `package/module` (`ledger/steps`)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    rows: dict[str, set[str]] = {}
    for line in text.split("### Checkpoint stages", 1)[1].splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 3 and cells[0].split()[0].strip("`/") in STAGE_ORDER:
            rows[cells[0].split()[0].strip("`/")] = set(re.findall(r"`([a-z_]+(?:/[a-z_]+)*)`", cells[1]))
    folders = {
        stage: {
            "/".join(path_of(name).relative_to(CHECKPOINT_DIR / stage).with_suffix("").parts)
            for name in names
            if path_of(name).name != "__init__.py"
        }
        for stage, names in STAGES.items()
        if stage != API
    }
    folders[API] = {name.rpartition(".")[2] if name != CHECKPOINT else "__init__" for name in STAGES.get(API, ())}
    wrong = {
        stage: (sorted(rows.get(stage, ())), sorted(names))
        for stage, names in folders.items()
        if rows.get(stage) != names
    }
    assert wrong == {}, f"docs/architecture.md (table, folder) disagree: {wrong}"


def _torch_imports(module: str) -> list[str]:
    path = path_of(module)
    return [where(path, line) for line, name in imports_of(path) if name == "torch" or name.startswith("torch.")]


def test_format_and_store_stages_import_no_torch() -> None:
    graph = import_graph(("dcs_tasks",))
    roots = [*TORCH_FREE, *(module_name(p) for top in TORCH_FREE_PACKAGES for p in files_of(top))]
    missing = [name for name in roots if not is_module(name)]
    assert missing == [], f"TORCH_FREE names modules that do not exist: {missing}"
    parents: dict[str, str | None] = dict.fromkeys(roots)
    queue = deque(roots)
    while queue:
        node = queue.popleft()
        for child in sorted(graph.get(node, {})):
            if child not in parents:
                parents[child] = node
                queue.append(child)
    wrong, excused = [], set()
    for module in sorted(parents):
        places = _torch_imports(module)
        if not places:
            continue
        if module in TORCH_EXCEPTIONS:
            excused.add(module)
            continue
        chain = [module]
        while (parent := parents[chain[-1]]) is not None:
            chain.append(parent)
        wrong.append(f"{module} imports torch at {', '.join(places)} (reached: {' <- '.join(chain)})")
    assert wrong == [], "torch in the format/store stages:\n" + "\n".join(wrong)
    stale = sorted(set(TORCH_EXCEPTIONS) - excused)
    assert stale == [], f"TORCH_EXCEPTIONS no longer needed (remove them): {stale}"


def test_the_cycle_finder_names_every_cycle_once() -> None:
    graph = {"a": {"b": []}, "b": {"c": [], "a": []}, "c": {"a": []}, "d": {"a": []}}
    assert cycles(graph) == [["a", "b", "a"], ["a", "b", "c", "a"]]
    assert cycles({"x": {"y": []}, "y": {}}) == []
