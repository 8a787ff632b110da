"""What a generative objective reads from a batch: `Field` and `InputSpec`.

An `InputSpec` lists named fields with their per-example shapes. The first field is the
*sample* field: what the model generates (an image ``(H, W, C)``, say). Every other field
is a *condition* the model is given (a prompt's token ids, a class label), turned into a
conditioning vector by the objective's encoders.

Sample values are read as pixels: ``uint8`` in ``[0, 255]`` maps to ``[-1, 1]``
(``x / 127.5 - 1``); floating-point values are taken to be in ``[-1, 1]`` already.

A field with a ``tokenizer`` holds token ids; ``InputSpec.tokenize(prompts)`` encodes a list
of strings into those fields (ids padded with ``pad_id`` or cut to the field's length), so a
conditioned run can generate from prompts alone, with no sample field in the batch.

Example:
    >>> inputs = InputSpec(Field("image", (4, 4, 1)))
    >>> inputs.sample.name, inputs.conditions
    ('image', ())
    >>> inputs.rows({"image": np.zeros((2, 4, 4, 1), np.uint8)})
    2
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dew_pipe._validate import check_int

__all__ = ["Field", "InputSpec", "pixels"]


def _encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text``: ``tokenizer.encode(text)`` (its ``.ids`` when it has them), or
    ``tokenizer(text)`` for a plain callable."""
    encode = getattr(tokenizer, "encode", None)
    out = encode(text) if encode is not None else tokenizer(text)
    return [int(i) for i in getattr(out, "ids", out)]


@dataclasses.dataclass(frozen=True)
class Field:
    """One named input of a generative model.

    Args:
        name: the batch key.
        shape: the per-example shape, e.g. ``(H, W, C)`` for an image or ``(L,)`` for ids.
        tokenizer: for a text condition: ``tokenizer.encode(text)`` (a Hugging Face
            ``tokenizers.Tokenizer`` or anything returning ids) or ``tokenizer(text)``.
        pad_id: the id written after a tokenized prompt ends.

    Raises:
        TypeError, ValueError: a name that is not a non-empty string, a shape that is not a
            tuple of positive ints, a tokenizer that is not callable and has no ``encode``.
    """

    name: str
    shape: tuple[int, ...]
    tokenizer: Any = None
    pad_id: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"Field name is {self.name!r}; expected a non-empty string")
        if not isinstance(self.shape, tuple | list) or not self.shape:
            raise TypeError(
                f"Field {self.name!r} shape is {self.shape!r}; expected a tuple of ints"
            )
        shape = tuple(
            check_int(f"Field {self.name!r} shape[{i}]", size, minimum=1)
            for i, size in enumerate(self.shape)
        )
        object.__setattr__(self, "shape", shape)
        if self.tokenizer is not None and not (
            callable(self.tokenizer) or callable(getattr(self.tokenizer, "encode", None))
        ):
            raise TypeError(
                f"Field {self.name!r} tokenizer is {self.tokenizer!r}; expected an object "
                "with encode(text) or a callable text -> ids"
            )
        if self.tokenizer is not None and len(shape) != 1:
            raise ValueError(
                f"Field {self.name!r} has a tokenizer and shape {shape}; expected a 1-D "
                "shape (L,) for token ids"
            )
        object.__setattr__(self, "pad_id", check_int("pad_id", self.pad_id, minimum=0))


class InputSpec:
    """The fields of a generative objective's batch: one sample field, then conditions.

    Args:
        *fields: the sample field first, then any condition fields; names must be unique.

    Raises:
        ValueError: no fields, a repeated name, or a sample field with a tokenizer.
        TypeError: an argument that is not a `Field`.
    """

    def __init__(self, *fields: Field) -> None:
        if not fields:
            raise ValueError("InputSpec has no fields; expected the sample field first")
        for field in fields:
            if not isinstance(field, Field):
                raise TypeError(f"InputSpec got {field!r}; expected dew_pipe.Field values")
        names = [field.name for field in fields]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"InputSpec repeats field name(s) {repeated}; expected unique names")
        if fields[0].tokenizer is not None:
            raise ValueError(
                f"InputSpec's first field {fields[0].name!r} has a tokenizer; expected the "
                "sample field (what the model generates) first, conditions after it"
            )
        self.fields = tuple(fields)

    @property
    def sample(self) -> Field:
        """The field the model generates."""
        return self.fields[0]

    @property
    def conditions(self) -> tuple[Field, ...]:
        """The fields the model is conditioned on."""
        return self.fields[1:]

    def __repr__(self) -> str:
        return f"InputSpec{tuple(self.fields)!r}"

    # ------------------------------------------------------------------ batches

    def rows(self, batch: Mapping[str, Any]) -> int:
        """The batch size: the sample field's rows, else the first condition present.

        Raises:
            ValueError: none of the spec's fields is in the batch, or one has the wrong
                per-example shape (naming the field and both shapes).
        """
        present = [field for field in self.fields if field.name in batch]
        if not present:
            raise ValueError(
                f"batch has fields {sorted(batch)}; expected at least one of "
                f"{[field.name for field in self.fields]}"
            )
        for field in present:
            shape = np.shape(batch[field.name])
            if tuple(shape[1:]) != field.shape:
                raise ValueError(
                    f"batch field {field.name!r} has shape {tuple(shape)}; expected "
                    f"(rows, {', '.join(map(str, field.shape))})"
                )
        return int(np.shape(batch[present[0].name])[0])

    def condition_fields(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """The condition fields of ``batch``, as they are (host or traced arrays).

        Raises:
            ValueError: a condition field is missing.
        """
        missing = [field.name for field in self.conditions if field.name not in batch]
        if missing:
            raise ValueError(
                f"batch has no condition field(s) {missing}; fields are {sorted(batch)}"
            )
        return {field.name: batch[field.name] for field in self.conditions}

    def tokenize(self, prompts: Sequence[str]) -> dict[str, np.ndarray]:
        """Encode ``prompts`` into every tokenized field: ``{name: int32 [B, L]}``.

        Each prompt's ids are cut to ``L`` or padded with the field's ``pad_id``. The
        result has no sample field: a rollout or preview generates from it alone.

        Raises:
            ValueError: the spec has no tokenized field, or ``prompts`` is empty.
            TypeError: a prompt that is not a string.

        Example:
            >>> spec = InputSpec(Field("image", (4, 4, 1)),
            ...                  Field("prompt", (3,), tokenizer=lambda s: [len(w) for w in s.split()]))
            >>> spec.tokenize(["a bb", "ccc dd e f"])["prompt"].tolist()
            [[1, 2, 0], [3, 2, 1]]
        """
        fields = [field for field in self.conditions if field.tokenizer is not None]
        if not fields:
            raise ValueError(f"tokenize needs a field with a tokenizer; {self!r} has none")
        if isinstance(prompts, str) or not len(prompts):
            raise ValueError(f"prompts is {prompts!r}; expected a non-empty list of strings")
        out = {}
        for field in fields:
            (length,) = field.shape
            ids = np.full((len(prompts), length), field.pad_id, np.int32)
            for row, text in enumerate(prompts):
                if not isinstance(text, str):
                    raise TypeError(f"prompts[{row}] is {text!r}; expected a string")
                encoded = _encode(field.tokenizer, text)[:length]
                ids[row, : len(encoded)] = encoded
            out[field.name] = ids
        return out


def pixels(values: Any) -> jax.Array:
    """Sample-field values as float32 in ``[-1, 1]`` (``uint8`` maps ``0..255`` onto it).

    Traceable: objectives call it inside their compiled loss.
    """
    array = jnp.asarray(values)
    if array.dtype == jnp.uint8:
        return array.astype(jnp.float32) / 127.5 - 1.0
    if not jnp.issubdtype(array.dtype, jnp.number) or jnp.issubdtype(
        array.dtype, jnp.complexfloating
    ):
        raise TypeError(f"sample values have dtype {array.dtype}; expected uint8 or floats")
    return array.astype(jnp.float32)
