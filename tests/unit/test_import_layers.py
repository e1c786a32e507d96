"""The import graph follows the layers of docs/architecture.md ("Layers of dcs_tasks"): every import in
`dcs_tasks` points to a lower layer, `dcs_tasks` imports neither service (`coordinator`, `workers`), the
services do not import each other, and no product code (`dcs_tasks`, the services, `bench`, `examples`)
imports `tests`.

Every import statement counts, wherever it stands: module level, inside a function, under `TYPE_CHECKING`
(a lazy import still ties the packages together), and `importlib.import_module("...")` with a literal name.
A failure names the file, the line and the import that breaks the rule.
"""

from __future__ import annotations

from tests.unit.importgraph import ROOT, files_of, imports_in, imports_of, module_name, where

PACKAGE = "dcs_tasks"

# Each subpackage of dcs_tasks and its layer; the modules directly in dcs_tasks/ (errors, config, models,
# coordinator_api, ...) are the base, layer 0. A unit may import only from units of lower layers (and itself).
LAYERS: dict[str, int] = {
    "base": 0,
    "backends": 1,
    "storage": 1,
    "checkpoint": 2,
    "sync": 2,
    "client": 3,
    "interop": 3,
    "local": 4,
    "integrations": 4,
    "cli": 5,
}
SERVICES = ("coordinator", "workers")
PRODUCT = (PACKAGE, *SERVICES, "bench", "examples")


def unit_of(module: str) -> str:
    """The layer unit of a dcs_tasks module: its subpackage, or "base" for the package root and its modules."""
    parts = module.split(".")
    if len(parts) > 1 and (ROOT / PACKAGE / parts[1] / "__init__.py").is_file():
        return parts[1]
    return "base"


def test_every_subpackage_has_a_layer() -> None:
    packages = {p.parent.name for p in (ROOT / PACKAGE).glob("*/__init__.py")}
    assert packages - LAYERS.keys() == set(), "give each new subpackage a layer in LAYERS and docs/architecture.md"


def test_dcs_tasks_imports_only_downward() -> None:
    wrong = []
    for path in files_of(PACKAGE):
        unit = unit_of(module_name(path))
        for line, target in imports_of(path):
            if target.split(".")[0] != PACKAGE or unit_of(target) == unit:
                continue
            other = unit_of(target)
            if LAYERS[other] >= LAYERS[unit]:
                lower = sorted((u for u in LAYERS if LAYERS[u] < LAYERS[unit]), key=LAYERS.__getitem__)
                wrong.append(
                    f"{where(path, line)} imports {target}: {unit} (layer {LAYERS[unit]}) may import only "
                    f"{', '.join(lower) or 'nothing outside itself'}, not {other} (layer {LAYERS[other]})"
                )
    assert wrong == [], "imports against the layers of docs/architecture.md:\n" + "\n".join(wrong)


def test_dcs_tasks_imports_no_service_and_services_not_each_other() -> None:
    forbidden = {PACKAGE: set(SERVICES), "coordinator": {"workers"}, "workers": {"coordinator"}}
    wrong = [
        f"{where(path, line)} ({top}) imports {target}"
        for top, banned in forbidden.items()
        for path in files_of(top)
        for line, target in imports_of(path)
        if target.split(".")[0] in banned
    ]
    assert wrong == [], "\n".join(wrong)


def test_product_code_never_imports_tests() -> None:
    wrong = [
        f"{where(path, line)} imports {target}"
        for path in files_of(*PRODUCT)
        for line, target in imports_of(path)
        if target.split(".")[0] == "tests"
    ]
    assert wrong == [], "\n".join(wrong)


def test_the_checker_sees_lazy_relative_and_dynamic_imports() -> None:
    source = "def f():\n    from dcs_tasks.client import engine\n\n"
    source += "from .wire import X\nimport importlib\nimportlib.import_module('coordinator.app')\n"
    found = sorted(target for _, target in imports_in(source, "dcs_tasks.sync"))
    assert found == ["coordinator.app", "dcs_tasks.client.engine", "dcs_tasks.sync.wire", "importlib"]
