"""Run a function right after a module is imported, wherever the script imports it from: how
ftrun puts its pieces into a framework (Lightning's strategy registry) that the script imports
after the worker started, without importing the framework itself (it may not be installed, and
importing it costs seconds). A finder on sys.meta_path finds the module with the other finders
and chains its loader: the module executes as it would, then the function runs on it.
Must never change what a module executes, and never import the supervisor.
"""

from __future__ import annotations

import importlib.abc
import sys
from types import ModuleType
from typing import Any, Callable, Dict, Optional, Sequence


class _Chained(importlib.abc.Loader):
    def __init__(self, loader: Any, after: Callable[[ModuleType], None]) -> None:
        self.loader, self.after = loader, after

    def create_module(self, spec: Any) -> Optional[ModuleType]:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # The module sees its own loader, as if nothing were chained.
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        self.after(module)


class _AfterImport(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.hooks: Dict[str, Callable[[ModuleType], None]] = {}

    def find_spec(self, name: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None) -> Any:
        after = self.hooks.pop(name, None)  # once: the module is then in sys.modules
        if after is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Chained(spec.loader, after)
                return spec
        return None


_finder: Optional[_AfterImport] = None


def after_import(name: str, fn: Callable[[ModuleType], None]) -> None:
    """Call fn(module) once `name` is imported (at once when it already is)."""
    global _finder
    if name in sys.modules:
        fn(sys.modules[name])
        return
    if _finder is None:
        _finder = _AfterImport()
        sys.meta_path.insert(0, _finder)
    _finder.hooks[name] = fn
