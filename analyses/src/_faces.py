"""A package face whose names are imported on first use (PEP 562): `interp.analyses` and its rooms export their
analyzers without importing them (torch, pandas) until one is asked for."""

from __future__ import annotations

import importlib


def lazy_face(package: str, names: dict[str, str]):
    """(__getattr__, __dir__) for the package `package`, whose `names` map each exported name to the module that
    defines it (relative to the package, or absolute). A name once asked for is kept in the package's namespace."""
    module_globals = importlib.import_module(package).__dict__

    def __getattr__(name: str):
        if name in names:
            value = getattr(importlib.import_module(names[name], package), name)
            module_globals[name] = value  # later lookups skip this function
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__():
        return sorted([*module_globals, *names])

    return __getattr__, __dir__
