"""Strings as fixed-width columns of UTF-8 bytes, and back.

Prompt batches carry their reward metadata (``data_source``, ``ground_truth``, ``extra_info``)
as ``[B, M]`` int32 arrays: row ``b`` holds the UTF-8 bytes of value ``b`` followed by zeros.
Numeric arrays travel through the same channels as token ids (device transfers, Arrow
``FixedSizeList`` columns, process gathers), which strings cannot. int32 rather than uint8
matches the layout the spec's hand-built prompt batch uses.

Zero is the padding byte, so a value may not contain the NUL character: it would come back
shortened. :func:`encode_text_column` refuses it instead of losing it.

Example:
    >>> column = encode_text_column(["dog", "naïve", ""])
    >>> column.shape, column.dtype
    ((3, 6), dtype('int32'))
    >>> decode_text_column(column)
    ['dog', 'naïve', '']
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["decode_text_column", "encode_text_column"]


def encode_text_column(
    values: Sequence[str], width: int | None = None, *, field: str = "text"
) -> np.ndarray:
    """Encode strings as a ``[len(values), width]`` int32 array of zero-padded UTF-8 bytes.

    Args:
        values: the strings, one per row.
        width: bytes per row; ``None`` uses the longest value's byte length (0 when every
            value is empty).
        field: how errors name the column (e.g. ``"extra_info"``).

    Returns:
        An int32 array whose row ``i`` holds the UTF-8 bytes of ``values[i]``, then zeros.

    Raises:
        TypeError: ``values`` is a single str, or holds a non-str.
        ValueError: a value contains the NUL character or a lone surrogate, a value is longer
            than ``width`` bytes, or ``width`` is negative.

    Example:
        >>> encode_text_column(["ab", "é"], width=3).tolist()
        [[97, 98, 0], [195, 169, 0]]
    """
    if isinstance(values, (str, bytes)):
        raise TypeError(f"{field}: values is a {type(values).__name__}; expected a sequence of str")
    encoded = []
    for row, value in enumerate(values):
        if not isinstance(value, str):
            raise TypeError(f"{field}: row {row} is {type(value).__name__} {value!r}; expected str")
        if "\0" in value:
            raise ValueError(
                f"{field}: row {row} contains the NUL character at index {value.index(chr(0))}; "
                "expected text without it (zero is the padding byte)"
            )
        try:
            encoded.append(value.encode("utf-8"))
        except UnicodeEncodeError as error:  # a lone surrogate, e.g. from a bad decode
            raise ValueError(
                f"{field}: row {row} has no UTF-8 form ({error.reason} at index {error.start}); "
                "expected text of valid Unicode characters"
            ) from error
    lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
    longest = int(lengths.max(initial=0))
    if width is None:
        width = longest
    elif isinstance(width, bool) or not isinstance(width, (int, np.integer)) or width < 0:
        raise ValueError(f"{field}: width is {width!r}; expected None or an int >= 0")
    elif longest > width:
        row = int(np.argmax(lengths > width))
        raise ValueError(
            f"{field}: row {row} is {int(lengths[row])} UTF-8 bytes, longer than the width "
            f"{width}; expected at most {width} bytes"
        )
    out = np.zeros((len(encoded), int(width)), dtype=np.int32)
    total = int(lengths.sum())
    if total:
        starts = np.cumsum(lengths) - lengths
        rows = np.repeat(np.arange(len(encoded)), lengths)
        columns = np.arange(total) - np.repeat(starts, lengths)
        out[rows, columns] = np.frombuffer(b"".join(encoded), dtype=np.uint8)
    return out


def decode_text_column(column: Any, *, field: str = "text") -> list[str]:
    """Decode a ``[B, M]`` array of zero-padded UTF-8 bytes into ``B`` strings.

    Trailing zeros are padding and are removed; the rest of each row must be valid UTF-8.
    This is the inverse of :func:`encode_text_column`.

    Args:
        column: an integer array (NumPy, or anything ``np.asarray`` accepts, such as a JAX
            array) of shape ``[B, M]`` with values in ``[0, 255]``.
        field: how errors name the column.

    Returns:
        The ``B`` decoded strings.

    Raises:
        TypeError: a non-integer array.
        ValueError: an array that is not 2-D, a value outside ``[0, 255]``, or a row that is
            not valid UTF-8 (the row is named).

    Example:
        >>> decode_text_column([[100, 111, 103, 0], [0, 0, 0, 0]])
        ['dog', '']
    """
    array = np.asarray(column)
    if array.dtype.kind not in "iu":
        raise TypeError(f"{field} has dtype {array.dtype}; expected an integer array of bytes")
    if array.ndim != 2:
        raise ValueError(f"{field} has shape {array.shape}; expected [B, M] bytes")
    bad = (array < 0) | (array > 255)
    if bad.any():
        row, col = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"{field}: row {row} holds {int(array[row, col])} at byte {col}; expected byte values "
            "in [0, 255]"
        )
    data = array.astype(np.uint8)
    if data.shape[1] == 0:
        return [""] * data.shape[0]
    nonzero = data != 0
    # Length of each row without its trailing zeros: width minus the run of zeros at its end.
    lengths = np.where(nonzero.any(axis=1), data.shape[1] - np.argmax(nonzero[:, ::-1], axis=1), 0)
    out = []
    for row, length in enumerate(lengths.tolist()):
        raw = data[row, :length].tobytes()
        try:
            out.append(raw.decode("utf-8"))
        except UnicodeDecodeError as error:
            raise ValueError(
                f"{field}: row {row} is not valid UTF-8 ({error.reason} at byte {error.start}); "
                "expected zero-padded UTF-8 bytes"
            ) from error
    return out
