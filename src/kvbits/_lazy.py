"""Lazy package exports: ``from kvbits.calibrate import calibrate`` works, but ``import kvbits.calibrate.cli`` (what
``kvbits --help`` does for each command) no longer imports torch, transformers and ``torch._dynamo`` with it.

A package calls ``__getattr__ = lazy_exports(__name__, {"calibrate": "calibrate", ...})`` (public name -> the
submodule defining it); a name is imported on its first use (PEP 562) and then bound like an eager import.
``dir()`` lists the exports not used yet, and any other submodule is imported as an attribute (``kvbits.report.render``).
A submodule named like a function it exports (``kvbits.calibrate.calibrate``, ``kvbits.monitor.watch``,
``kvbits.report.verdict``) never binds over that name when imported: the package attribute stays the function, as it
was when the package imported it eagerly (the module stays in ``sys.modules`` under its full name).
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


class _LazyPackage(types.ModuleType):
    """The module type of a package with lazy exports (see the module docstring)."""

    _lazy_exports: Mapping[str, str]

    def __setattr__(self, name: str, value: Any) -> None:
        exports = self.__dict__.get("_lazy_exports", {})
        if isinstance(value, types.ModuleType) and name in exports and value.__name__ == f"{self.__name__}.{name}":
            return  # the submodule of the same name: the package attribute is the function it exports
        super().__setattr__(name, value)

    def __dir__(self) -> list[str]:
        # the exports not imported yet too, as the eager package listed them: tab completion, help(), getmembers
        return sorted(set(super().__dir__()) | set(self.__dict__.get("_lazy_exports", {})))


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """The module ``__getattr__`` of ``package`` that imports ``exports[name]`` (a submodule) for ``name``."""
    module = sys.modules[package]
    module.__dict__["_lazy_exports"] = dict(exports)
    module.__class__ = _LazyPackage

    def __getattr__(name: str) -> Any:
        submodule = exports.get(name)
        if submodule is None:
            return _submodule(package, name)
        try:
            defining = importlib.import_module(f"{package}.{submodule}")
        except AttributeError as error:
            # raised inside the submodule: out of a module __getattr__ it would read as "no such name" (hasattr
            # False, `from package import name` an ImportError without its cause), so it is re-raised as what it is
            raise ImportError(f"importing {package}.{submodule} (for {package}.{name}) failed: {error}") from error
        value = getattr(defining, name)
        module.__dict__[name] = value  # bound once: later lookups do not come here
        return value

    return __getattr__


def _submodule(package: str, name: str) -> types.ModuleType:
    """``package.name`` as an attribute, imported now: the eager package had imported (and bound) its submodules, so
    ``import kvbits.report`` then ``kvbits.report.render`` worked; an unknown name is an ``AttributeError``."""
    if not name.startswith("_"):  # dunder probes (``__wrapped__``, ``__path__`` ...) are never submodules
        try:
            return importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError as error:
            if error.name != f"{package}.{name}":
                raise  # the submodule exists but needs a module that is missing: that is the error to see
        except AttributeError as error:
            # raised inside the submodule: out of a module __getattr__ it would read as "no such name" (as in
            # lazy_exports' __getattr__), so it is re-raised as what it is
            raise ImportError(f"importing {package}.{name} failed: {error}") from error
    raise AttributeError(f"module {package!r} has no attribute {name!r}")
