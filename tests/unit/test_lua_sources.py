"""The Lua sources (`lua/*.lua` beside the modules that run them, dcs_tasks/lua.py): every file is loaded by some
module, every file a module loads exists, each documents its KEYS and ARGV at its top, the wheel ships them all,
and a missing or malformed file is an InstallationError naming it."""

from __future__ import annotations

import ast
import fnmatch
import importlib
import tomllib
from pathlib import Path

import pytest

from dcs_tasks import lua
from dcs_tasks.errors import InstallationError

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("dcs_tasks", "coordinator", "workers")


def _lua_files() -> set[Path]:
    return {p.resolve() for package in PACKAGES for p in (ROOT / package).rglob("*.lua")}


def _loader_calls() -> dict[Path, list[str]]:
    """Each product module that calls `lua_script(__file__, "name.lua")` -> the names it loads (read from its AST)."""
    calls: dict[Path, list[str]] = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "lua_script(" not in path.read_text():
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "lua_script":
                    name = node.args[1]
                    assert isinstance(name, ast.Constant), f"{path}: lua_script's name must be a literal"
                    calls.setdefault(path, []).append(name.value)
    return calls


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def test_every_lua_file_is_loaded_by_a_module_and_every_loaded_file_exists() -> None:
    calls = _loader_calls()
    assert calls, "no module loads Lua: the scan is broken"
    for path, names in calls.items():
        for name in names:
            assert (path.parent / lua.LUA_FOLDER / name).is_file(), f"{path} loads {name}, which does not exist"
        importlib.import_module(_module_name(path))
    loaded = {p.resolve() for p in lua.LOADED}
    unused = sorted(str(p.relative_to(ROOT)) for p in _lua_files() - loaded)
    assert unused == [], f".lua files no module loads (or includes): {unused}"
    assert len(_lua_files()) >= 26


def test_each_lua_file_documents_its_keys_and_argv_at_its_top() -> None:
    for path in _lua_files():
        header = []
        for line in path.read_text().splitlines():
            if not line.startswith("--"):
                break
            header.append(line)
        text = "\n".join(header)
        assert header and "KEYS[" in text, f"{path}: no KEYS documented in its leading comment"


def test_the_wheel_ships_every_lua_file() -> None:
    """pyproject.toml's package-data globs cover each file (a non-editable install, the compose image, gets them)."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    for path in _lua_files():
        package_dir = path.parent.parent
        package = ".".join(package_dir.relative_to(ROOT).parts)
        relative = str(path.relative_to(package_dir))
        globs = [*data.get("*", []), *data.get(package, [])]
        assert (package_dir / "__init__.py").is_file(), f"{path}'s lua/ folder is not beside a package's modules"
        assert any(fnmatch.fnmatch(relative, g) for g in globs), f"{relative} of {package} not in package-data"


def test_a_missing_lua_file_is_an_installation_error_naming_it(tmp_path: Path) -> None:
    module = tmp_path / "scripts.py"
    with pytest.raises(InstallationError, match=r"lua/gone\.lua cannot be read.*package-data"):
        lua.lua_script(str(module), "gone.lua")


def test_includes_are_expanded_once_and_bounded(tmp_path: Path) -> None:
    folder = tmp_path / "lua"
    folder.mkdir()
    (folder / "lib.lua").write_text("-- KEYS[1] none\nlocal function one() return 1 end\n")
    (folder / "main.lua").write_text("-- KEYS[1] k\n--#include lib.lua\nreturn one()\n")
    script = lua.lua_script(str(tmp_path / "scripts.py"), "main.lua")
    assert script.source == "-- KEYS[1] k\n-- KEYS[1] none\nlocal function one() return 1 end\nreturn one()\n"
    (folder / "lib.lua").write_text("--#include main.lua\n")
    with pytest.raises(InstallationError, match="includes nothing"):
        lua.lua_script(str(tmp_path / "scripts.py"), "main.lua")
    (folder / "main.lua").write_text("--#include ../secret.lua\n")
    with pytest.raises(InstallationError, match=r"not of the form name\.lua"):
        lua.lua_script(str(tmp_path / "scripts.py"), "main.lua")
