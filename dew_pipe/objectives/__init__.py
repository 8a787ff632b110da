"""Objectives: pure losses the Trainer differentiates.

Names resolve lazily (module ``__getattr__``) so importing the package costs nothing until a
name is used. To export a new name, add it to ``_LAZY`` with the module that defines it.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY: dict[str, str] = {
    "LMObjective": "dew_pipe.objectives.lm",
    "Objective": "dew_pipe.objectives.base",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dew_pipe.objectives' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
