"""Import-time stand-ins for packages SGLang imports but cannot load on a CPU-only torch.

Only packages whose PyPI wheels need a CUDA build of torch (or a GPU) are stubbed; every stub is
permissive (any attribute, call, subclass or decorator works) and never reached by the
weight-update path. Everything else SGLang imports is the real package (see Makefile `sglang-engines`).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Sequence
from typing import Any


class _AnyMeta(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _make(name)

    def __or__(cls, other: Any) -> Any:
        return cls

    def __ror__(cls, other: Any) -> Any:
        return cls

    def __getitem__(cls, item: Any) -> Any:
        return cls


class _Anything(metaclass=_AnyMeta):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._args = args

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return _Anything()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _Anything()


def _make(name: str) -> type:
    return _AnyMeta(name, (_Anything,), {})


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = _make(name)
        setattr(self, name, value)
        return value


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots: Sequence[str]) -> None:
        self.roots = tuple(roots)

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".")[0] not in self.roots:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0+stub"
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def install_stubs(roots: Sequence[str]) -> None:
    """Make `import ROOT[.anything]` yield permissive stub modules for each ROOT (once per process)."""
    if not any(isinstance(finder, _StubFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _StubFinder(roots))
