"""Name -> object registries with one signature each, and errors that list the valid names.

A registry made with `plugins=True` (suites, tools) also resolves names it does not hold itself, so a user's
suite or tool needs no launcher script:

- an import path `package.module:attr` (the current directory is importable, as under `python -m`);
- an entry point of the registry's group (e.g. `agentgrad.suites`), which an installed package declares in its
  `pyproject.toml` (`[project.entry-points."agentgrad.suites"] my-suite = "my_pkg.suite:MySuite"`).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Iterator
from importlib import metadata
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class UnknownNameError(KeyError):
    """Raised when a registry has no entry of that name. The message lists the valid names."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it readable
        return str(self.args[0])


class ImportRefError(ValueError):
    """An import path (`package.module:attr`) that cannot be resolved; the one-line message says why."""


def import_ref(spec: str, *, what: str = "object") -> Any:
    """The object `package.module:attr` names (`attr` may be dotted), importing the module.

    The current directory goes on `sys.path` first, as `python -m` does: console scripts (`agentgrad ...`) start
    without it, so `examples.custom_reward:short_and_right` would otherwise not import from the repository root.
    Errors are one line (`ImportRefError`), never the importer's traceback."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ImportRefError(f"{what} reference {spec!r} must look like 'package.module:attr'")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportRefError(f"cannot import module {module_name!r} for {what} {spec!r}: {exc} "
                             f"(run from the directory that holds it, or install its package)") from None
    except Exception as exc:  # the user's module raised while importing: say where, in one line
        raise ImportRefError(f"importing {module_name!r} for {what} {spec!r} failed: "
                             f"{type(exc).__name__}: {exc}") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ImportRefError(f"module {module_name!r} has no attribute {attr!r} ({what} {spec!r})") from None
    return obj


class Registry(Generic[T]):
    def __init__(self, kind: str, *, plugins: bool = False, entry_point_group: str | None = None) -> None:
        self.kind = kind
        self.plugins = plugins
        self.entry_point_group = entry_point_group if plugins else None
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def decorator(obj: T) -> T:
            self.add(name, obj)
            return obj

        return decorator

    def add(self, name: str, obj: T) -> None:
        if name in self._items:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._items[name] = obj

    def _entry_points(self) -> dict[str, metadata.EntryPoint]:
        if self.entry_point_group is None:
            return {}
        return {ep.name: ep for ep in metadata.entry_points(group=self.entry_point_group)}

    def get(self, name: str) -> T:
        """A registered entry; with plugins, else an import path (`module:attr`), else an entry point."""
        if name in self._items:
            return self._items[name]
        if not self.plugins:
            raise UnknownNameError(f"unknown {self.kind} {name!r}; valid names: {', '.join(self.names()) or '(none)'}")
        if ":" in name:
            return import_ref(name, what=self.kind)
        ep = self._entry_points().get(name)
        if ep is not None:
            try:
                return ep.load()
            except Exception as exc:
                raise ImportRefError(f"entry point {name!r} ({ep.value}) of {self.entry_point_group!r} failed "
                                     f"to load: {type(exc).__name__}: {exc}") from None
        hint = "; or an import path 'package.module:attr'" + (
            f" or an entry point of {self.entry_point_group!r}" if self.entry_point_group else "")
        raise UnknownNameError(f"unknown {self.kind} {name!r}; valid names: {', '.join(self.names()) or '(none)'}"
                               f"{hint}")

    def resolvable(self, name: str) -> bool:
        """Whether `get(name)` would find something (without importing a module path)."""
        return name in self._items or (self.plugins and (":" in name or name in self._entry_points()))

    def names(self) -> list[str]:
        return sorted(set(self._items) | set(self._entry_points()))

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._items))
