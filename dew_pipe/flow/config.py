"""Settings of a pipeline file: a factory's keyword parameters, overridden by ``key=value``.

A factory such as ``def pipeline(batches: int = 24, rate: float = 0.5, out: Path = Path("x"))``
has the settings ``batches``, ``rate`` and ``out``. Text values convert by annotation:
``int``, ``float``, ``bool`` (true/false, yes/no, on/off, 1/0), ``str``, ``Path``, an
``Enum`` (by member name), a ``Literal``, ``X | None`` ("none"), and tuples or lists of these
written comma-separated (``1,2,3``; brackets optional). An unannotated parameter converts like
its default.
"""

from __future__ import annotations

import enum
import inspect
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}
_NONE = {"none", "null"}


class ConfigError(ValueError):
    """A setting that does not exist, or a value that does not convert."""


@dataclass(frozen=True)
class Setting:
    """One keyword parameter of a factory."""

    name: str
    annotation: Any
    default: Any

    @property
    def type_name(self) -> str:
        return _type_name(self.annotation)

    def parse(self, text: str) -> Any:
        """Convert ``text`` by the annotation; raises ValueError saying what was expected."""
        return _convert(text.strip(), self.annotation)

    def describe(self) -> str:
        return f"{self.name} ({self.type_name}, default {_show(self.default)})"


def _show(value: Any) -> str:
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, tuple | list):
        return ",".join(_show(v) for v in value)
    return str(value)


def _type_name(t: Any) -> str:
    if t is type(None):
        return "None"
    if isinstance(t, type) and not typing.get_args(t):
        return t.__name__
    return str(t).replace("typing.", "").replace("pathlib.", "")


def settings_of(factory: Callable[..., Any]) -> dict[str, Setting]:
    """The settings of ``factory``: every parameter, each of which needs a default.

    Raises:
      ConfigError: a parameter without a default, or ``*args``/``**kwargs``.

    Example:
      >>> def f(n: int = 2, name="x"): ...
      >>> [s.describe() for s in settings_of(f).values()]
      ['n (int, default 2)', 'name (str, default x)']
    """
    try:
        hints = typing.get_type_hints(factory)
    except Exception as e:  # an annotation naming something the file did not import
        raise ConfigError(f"cannot resolve the annotations of {factory.__name__}(): {e}") from e
    out = {}
    for p in inspect.signature(factory).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise ConfigError(
                f"{factory.__name__}() takes *{p.name}; list each setting as a parameter"
            )
        if p.default is p.empty:
            raise ConfigError(
                f"{factory.__name__}() parameter {p.name!r} has no default; every parameter "
                "needs one so dew-pipe can call it"
            )
        annotation = hints.get(p.name)
        if annotation is None:
            annotation = type(p.default) if p.default is not None else str
        out[p.name] = Setting(p.name, annotation, p.default)
    return out


def resolve(factory: Callable[..., Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Defaults of ``factory``'s settings with ``key=value`` overrides applied.

    Raises:
      ConfigError: one line naming the key or value and listing the valid settings.

    Example:
      >>> def f(n: int = 2, scale: float = 1.0): ...
      >>> resolve(f, ["n=5"])
      {'n': 5, 'scale': 1.0}
    """
    settings = settings_of(factory)
    valid = "; ".join(s.describe() for s in settings.values()) or "none"
    config = {name: s.default for name, s in settings.items()}
    seen = set()
    for text in overrides:
        key, sep, value = text.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--set {text!r}: expected key=value; valid settings: {valid}")
        if key not in settings:
            raise ConfigError(f"unknown setting {key!r}; valid settings: {valid}")
        if key in seen:
            raise ConfigError(f"setting {key!r} is given twice")
        seen.add(key)
        try:
            config[key] = settings[key].parse(value)
        except ValueError as e:
            raise ConfigError(f"setting {key!r}: {e}; valid settings: {valid}") from e
    return config


def to_json(config: Mapping[str, Any]) -> dict[str, Any]:
    """Config values as JSON-ready values (paths as text, enums by name, tuples as lists)."""

    def plain(v: Any) -> Any:
        if isinstance(v, Path):
            return str(v)
        if isinstance(v, enum.Enum):
            return v.name
        if isinstance(v, tuple | list):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {str(k): plain(x) for k, x in v.items()}
        if v is None or isinstance(v, bool | int | float | str):
            return v
        return repr(v)

    return {k: plain(v) for k, v in config.items()}


def _convert(text: str, t: Any) -> Any:
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        if len(options) < len(args) and text.lower() in _NONE:
            return None
        for option in options:
            try:
                return _convert(text, option)
            except ValueError:
                continue
        raise ValueError(f"{text!r} is not {_type_name(t)}")
    if origin is typing.Literal:
        for choice in args:
            if str(choice.name if isinstance(choice, enum.Enum) else choice) == text:
                return choice
        raise ValueError(f"{text!r} is not one of {', '.join(map(str, args))}")
    if origin in (tuple, list) or t in (tuple, list):
        return _sequence(text, origin or t, args)
    if t is bool:
        if text.lower() in _TRUE | _FALSE:
            return text.lower() in _TRUE
        raise ValueError(f"{text!r} is not a bool (true/false, yes/no, on/off, 1/0)")
    if t is int:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{text!r} is not an int") from None
    if t is float:
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"{text!r} is not a float") from None
    if t is str:
        return text
    if isinstance(t, type) and issubclass(t, Path):
        return t(text)
    if isinstance(t, type) and issubclass(t, enum.Enum):
        if text in t.__members__:
            return t[text]
        raise ValueError(f"{text!r} is not one of {', '.join(t.__members__)}")
    raise ValueError(
        f"type {_type_name(t)} cannot be set from the command line; set it in the file"
    )


def _sequence(text: str, kind: type, args: tuple) -> tuple | list:
    inner = text.strip()
    if inner[:1] in "[(" and inner[-1:] in "])":
        inner = inner[1:-1]
    parts = [p.strip() for p in inner.split(",")] if inner.strip() else []
    if kind is tuple and args and args[-1] is not Ellipsis:
        if len(parts) != len(args):
            raise ValueError(f"{text!r} has {len(parts)} items, expected {len(args)}")
        return tuple(_convert(p, a) for p, a in zip(parts, args, strict=True))
    item = args[0] if args else str
    values = [_convert(p, item) for p in parts]
    return tuple(values) if kind is tuple else values
