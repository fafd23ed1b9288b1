"""Old import paths of the modules that moved to :mod:`fl_attack.testbed`, with a warning.

``fl_attack.data``, ``fl_attack.models``, ``fl_attack.simulate``, ``fl_attack.metrics`` and
``fl_attack.tabular`` now live in ``fl_attack.testbed``. Both spellings a user's code may have
keep working, each with a ``DeprecationWarning`` naming the new path, and both give the one
module object of the new path (no copies):

* ``from fl_attack import data`` / ``fl_attack.data``: the package's module ``__getattr__``;
* ``import fl_attack.data`` / ``from fl_attack.data import load_images``: a finder on
  ``sys.meta_path`` that answers only for those five names.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

MOVED = ("data", "models", "simulate", "metrics", "tabular")
NEW_HOME = "fl_attack.testbed"


def _warn(old: str, new: str) -> None:
    warnings.warn(f"{old} moved to {new}; import it from there (the old name will be removed)",
                  DeprecationWarning, stacklevel=3)


class _Alias(importlib.abc.Loader):
    """Loads an old name as the module of its new path."""

    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        _warn(spec.name, self.new)
        return importlib.import_module(self.new)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the new module is already executed."""


class _MovedFinder(importlib.abc.MetaPathFinder):
    """Finds ``fl_attack.<old>`` for the moved modules, and nothing else."""

    def __init__(self, package: str) -> None:
        self.package = package

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        head, _, name = fullname.rpartition(".")
        if head != self.package or name not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, _Alias(f"{NEW_HOME}.{name}"))


def install(package: str) -> Callable[[str], Any]:
    """Register the finder once; return the package's module ``__getattr__``."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder(package))

    def __getattr__(name: str) -> Any:
        if name in MOVED:
            _warn(f"{package}.{name}", f"{NEW_HOME}.{name}")
            return importlib.import_module(f"{NEW_HOME}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
