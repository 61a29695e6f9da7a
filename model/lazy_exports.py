"""Package exports imported on first use (PEP 562), for packages whose names pull in jax.

`model` and `serving` export names that live in modules importing jax; a process that needs
neither (the router, which only tokenizes) must be able to import the packages without it.
"""

from __future__ import annotations

import importlib


def lazy_exports(package: str, exports: dict[str, str]):
    """(`__getattr__`, `__dir__`) for a package: `exports` maps each name to the module defining it."""

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(exports[name]), name)  # a module imports once

    def __dir__():
        return sorted(set(exports) | set(vars(importlib.import_module(package))))

    return __getattr__, __dir__
