"""The package's one lazy-import mechanism: names a package exports, imported on first use.

A package ``__init__`` that would otherwise pull in torch or NeMo at import (the engine's
torch-free layout modules, the NeMo-facing strategy) names its exports here instead, so
``import nemo_gtp.engine.grid`` stays torch-free and ``import nemo_gtp`` stays NeMo-free.

Example::

    __getattr__, __dir__ = lazy_exports(__name__, {"GTPRuntime": "nemo_gtp.engine.runtime"})
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, exports: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A module ``__getattr__`` and ``__dir__`` (PEP 562) that import ``exports[name]`` on the
    first access of ``name`` and keep the value in the package's namespace."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)  # later lookups skip __getattr__
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
