"""Generated tasks: data, tokenizer, reward and evaluation made from a seed, nothing downloaded.

Names resolve lazily (module ``__getattr__``), so importing this package loads neither JAX
nor transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY: dict[str, str] = {
    "ArithmeticTask": "dew_pipe.tasks.arithmetic",
    "reward": "dew_pipe.tasks.arithmetic",
    "Problems": "dew_pipe.tasks.problems",
    "is_correct": "dew_pipe.tasks.problems",
    "build_char_tokenizer": "dew_pipe.tasks.char_tokenizer",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dew_pipe.tasks' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
