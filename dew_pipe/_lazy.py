"""Lazy package exports: a package lists its public names, each imported on first use.

Every package of dew_pipe keeps ``import dew_pipe.x`` cheap (no JAX, no transformers)
this way. A package declares ``{name: module}`` (the name is an attribute of that module)
or ``{name: (module, attribute)}`` (attribute None: the module itself) and installs the
module-level ``__getattr__``/``__dir__`` of PEP 562::

    __all__, __getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())

A name resolves once; the value is then stored in the package's namespace.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str,
    names: Mapping[str, str | tuple[str, str | None]],
    namespace: dict[str, Any],
) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """``(__all__, __getattr__, __dir__)`` for ``package`` exporting ``names`` lazily.

    Example:
        >>> all_, getattr_, dir_ = lazy_exports("pkg", {"sqrt": "math"}, space := {})
        >>> all_, getattr_("sqrt")(4.0), "sqrt" in space
        (['sqrt'], 2.0, True)
        >>> getattr_("cbrt")
        Traceback (most recent call last):
        ...
        AttributeError: module 'pkg' has no attribute 'cbrt'
    """
    targets = {
        name: (target, name) if isinstance(target, str) else target
        for name, target in names.items()
    }

    def __getattr__(name: str) -> Any:
        target = targets.get(name)
        if target is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(target[0])
        value = module if target[1] is None else getattr(module, target[1])
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(targets))

    return sorted(targets), __getattr__, __dir__
