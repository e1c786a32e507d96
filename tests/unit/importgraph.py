"""The import statements of the repository's Python files, read with `ast` (nothing is imported).

Every import statement counts, wherever it stands: module level, inside a function, under `TYPE_CHECKING`
(a lazy import still ties the modules together), and `importlib.import_module("...")` with a literal name.
`from a import b` counts as the module a.b where b is a module, else as a. Used by test_import_layers.py and
test_import_cycles.py.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def is_module(name: str) -> bool:
    """Whether `name` (dotted) is a module or package in this repository."""
    base = ROOT.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def path_of(name: str) -> Path:
    """The file of module or package `name` (which `is_module`)."""
    base = ROOT.joinpath(*name.split("."))
    return base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"


@functools.cache
def imports_of(path: Path) -> tuple[tuple[int, str], ...]:
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    return tuple(dict.fromkeys(imports_in(path.read_text(), package)))  # `from a import b, c`: a once


def imports_in(source: str, package: str) -> Iterator[tuple[int, str]]:
    """(line, dotted module) of every import in `source`, a module of `package`; `from a import b` counts as
    a.b where b is a module."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join([*anchor, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                yield node.lineno, sub if is_module(sub) else source
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield node.lineno, node.args[0].value


def files_of(*tops: str) -> list[Path]:
    return sorted(path for top in tops for path in (ROOT / top).rglob("*.py"))


def where(path: Path, line: int) -> str:
    return f"{path.relative_to(ROOT)}:{line}"
