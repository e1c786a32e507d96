"""No import cycles in product code, and the format and store stages of checkpoints import no torch.

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
from collections import deque
from collections.abc import Iterable, Mapping

from tests.unit.importgraph import files_of, imports_of, is_module, module_name, path_of, where

TOPS = ("dcs_tasks", "coordinator", "workers", "bench")

# The stages of dcs_tasks/checkpoint/ (docs/architecture.md, "Checkpoint stages"), in order: a module imports
# only modules of its own stage and of earlier ones (cycles inside a stage are caught above).
STAGES: dict[str, tuple[str, ...]] = {
    "format": ("format", "iosizes", "fsio", "compression", "validate"),
    "state": ("stageable", "dtensor_meta", "structure"),
    "store": (
        "landing",
        "objread",
        "zread",
        "steps",
        "latest",
        "ledger_scripts",
        "ledger",
        "incremental",
        "retention",
        "objlocks",
        "payloads",
        "peerwire",
        "tiers",
    ),
    "save": ("pinning", "copier", "staging", "cuda"),
    "restore": ("fastread", "reader", "sharded", "dtensor", "restoring"),
    "api": (
        "__init__",
        "checkpointer",
        "dispatch",
        "pending",
        "telemetry",
        "replicas",
        "committer",
        "trust",
        "persisting",
        "inline",
    ),
}
CHECKPOINT = "dcs_tasks.checkpoint"

# The format and store stages, with everything under dcs_tasks/storage/ and everything they import inside
# dcs_tasks, import no torch in any form (module level, lazily, under TYPE_CHECKING): a worker moves bytes.
TORCH_FREE = tuple(f"{CHECKPOINT}.{name}" for stage in ("format", "store") for name in STAGES[stage])
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


def _stage_module(name: str) -> str:
    return CHECKPOINT if name == "__init__" else f"{CHECKPOINT}.{name}"


def test_checkpoint_modules_import_only_their_own_and_earlier_stages() -> None:
    order = {_stage_module(name): rank for rank, names in enumerate(STAGES.values()) for name in names}
    stage_names = list(STAGES)
    present = {module_name(path) for path in files_of("dcs_tasks/checkpoint")}
    unplaced = sorted(present - order.keys())
    assert unplaced == [], f"give each checkpoint module a stage in STAGES and docs/architecture.md: {unplaced}"
    graph = import_graph(("dcs_tasks",))
    wrong = [
        f"{', '.join(places)}: {module} ({stage_names[order[module]]}) imports {target} "
        f"({stage_names[order[target]]}, a later stage)"
        for module in sorted(present)
        for target, places in sorted(graph[module].items())
        if target in order and order[target] > order[module]
    ]
    assert wrong == [], "checkpoint imports against the stage order:\n" + "\n".join(wrong)


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
