"""Name -> callable registries, and loading callables from "pkg.mod:fn" or "file.py:fn"."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Callable

from vlrft.errors import ConfigError


class Registry:
    """A small named table of callables; an unknown name fails listing the valid ones."""

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, Callable] = {}

    def register(self, name: str) -> Callable[[Callable], Callable]:
        def add(fn: Callable) -> Callable:
            if name in self._items:
                raise ValueError(f"{self.kind} '{name}' is registered twice")
            self._items[name] = fn
            return fn

        return add

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        return name in self._items

    def check(self, name: str, key: str) -> None:
        if name not in self._items:
            raise ConfigError(f"config key '{key}': unknown {self.kind} '{name}'; valid: {', '.join(self.names())}")

    def get(self, name: str) -> Callable:
        if name not in self._items:
            raise KeyError(f"unknown {self.kind} '{name}'; valid: {', '.join(self.names())}")
        return self._items[name]


def load_callable(spec: str) -> Callable:
    """Load "package.module:function" or "path/to/file.py:function"."""
    if ":" not in spec:
        raise ValueError(f"'{spec}' is not 'module:function' or 'file.py:function'")
    target, _, attr = spec.rpartition(":")
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise ValueError(f"'{spec}': file {path} not found")
        name = f"vlrft_user_{abs(hash(str(path.resolve())))}"
        module_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        module_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as err:
            raise ValueError(f"'{spec}': cannot import module '{target}' ({err})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"'{spec}': '{attr}' is not a callable in {target}")
    return fn
