"""Port types: an Arrow schema for batches, or a Python type for control messages.

A producer's port may feed a consumer's port when every field the consumer's schema names
is in the producer's schema with the same type (extra producer columns are fine), or, for
Python types, when the producer's type is a subclass of the consumer's. ``object`` (or
``typing.Any``) accepts anything.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

PortType = pa.Schema | type


@dataclass(frozen=True)
class Port:
    """A declared port: its type, whether the pipeline must connect it, and a short doc.

    An optional input that is not connected has ended from the start; items put on an
    optional output that is not connected are counted as ``discarded`` on the stage.

    Example:
      >>> Port(object, required=False).required
      False
    """

    type: PortType
    required: bool = True
    doc: str = ""

    def __post_init__(self):
        if self.type is typing.Any:
            object.__setattr__(self, "type", object)
        if not isinstance(self.type, pa.Schema | type):
            raise TypeError(f"port type {self.type!r}: expected a pyarrow.Schema or a Python class")


def as_port(spec: Port | PortType) -> Port:
    """A Port from a Port, a schema or a class."""
    return spec if isinstance(spec, Port) else Port(spec)


def describe(t: PortType, limit: int = 4) -> str:
    """A one-line description of a port type (first ``limit`` schema fields)."""
    if isinstance(t, pa.Schema):
        fields = [f"{f.name}: {f.type}" for f in t][:limit]
        more = f", ... {len(t) - limit} more" if len(t) > limit else ""
        return f"schema({', '.join(fields)}{more})"
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def incompatibility(produced: PortType, accepted: PortType) -> str | None:
    """Why ``produced`` cannot feed ``accepted`` (one short clause), or None when it can."""
    if isinstance(accepted, type):
        if isinstance(produced, type):
            if accepted is object or issubclass(produced, accepted):
                return None
            return f"{describe(produced)} is not a subclass of {describe(accepted)}"
        return None if accepted in (object, pa.RecordBatch) else "a schema is not a Python type"
    if not isinstance(produced, pa.Schema):
        return "a Python type is not an Arrow schema"
    return schema_mismatch(produced, accepted)


def schema_mismatch(produced: pa.Schema, accepted: pa.Schema) -> str | None:
    """The first field of ``accepted`` that ``produced`` lacks or types differently."""
    if produced is accepted or produced.equals(accepted):
        return None
    for field in accepted:
        index = produced.get_field_index(field.name)
        if index < 0:
            return f"field {field.name!r} is missing"
        actual = produced.field(index).type
        if actual != field.type:
            return f"field {field.name!r} is {actual}, expected {field.type}"
    return None


def item_mismatch(item: Any, t: PortType) -> str | None:
    """Why ``item`` does not fit a port of type ``t`` (checked on every put), or None."""
    if isinstance(t, pa.Schema):
        if not isinstance(item, pa.RecordBatch):
            return f"got a {type(item).__name__}, expected a pyarrow.RecordBatch"
        return schema_mismatch(item.schema, t)
    if isinstance(item, t):
        return None
    return f"got a {type(item).__name__}, expected {describe(t)}"
