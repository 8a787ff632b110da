"""Argument checks shared by every constructor: one wording for one kind of mistake.

A wrong type raises ``TypeError`` and a value out of range raises ``ValueError``; both name
the argument, repeat the value and say what was expected, e.g.
``groups is 0; expected an int >= 1``. ``bool`` is refused wherever a number is expected
(``True`` is an ``int`` to Python, never a count to a user); NumPy scalars are accepted and
returned as Python numbers, so the checked value can go straight into a dataclass field.

Example:
    >>> check_int("groups", 4, minimum=1)
    4
    >>> check_int("groups", 0, minimum=1)
    Traceback (most recent call last):
    ...
    ValueError: groups is 0; expected an int >= 1
    >>> check_float("temperature", 0.7, above=0.0)
    0.7
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["check_float", "check_int"]


def _expected(noun: str, low: str | None, high: str | None, allow_none: bool) -> str:
    if low and high:
        text = f"{noun} {low} and {high}"
    elif low or high:
        text = f"{noun} {low or high}"
    else:
        text = noun
    return f"None or {text}" if allow_none else text


def check_int(
    name: str,
    value: Any,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    allow_none: bool = False,
) -> int | None:
    """``value`` as an ``int`` within ``[minimum, maximum]`` (either bound optional).

    Args:
      name: the argument's name, as the caller spells it in messages.
      value: what the caller passed.
      minimum: smallest allowed value (inclusive), or None for no lower bound.
      maximum: largest allowed value (inclusive), or None for no upper bound.
      allow_none: accept ``None`` (returned as is), e.g. for "no limit".

    Returns:
      ``int(value)``, or None when ``value`` is None and ``allow_none``.

    Raises:
      TypeError: ``value`` is not an integer (a bool, a float, a string...).
      ValueError: ``value`` is outside the bounds.
    """
    if value is None and allow_none:
        return None
    low = None if minimum is None else f">= {minimum}"
    high = None if maximum is None else f"<= {maximum}"
    expected = _expected("an int", low, high, allow_none)
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} is {value!r}; expected {expected}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"{name} is {value!r}; expected {expected}")
    return int(value)


def check_float(
    name: str,
    value: Any,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    above: float | None = None,
    below: float | None = None,
    allow_none: bool = False,
) -> float | None:
    """``value`` as a finite ``float`` within the given bounds.

    Ints and NumPy reals are accepted and converted; ``bool``, NaN and infinities are not.

    Args:
      name: the argument's name, as the caller spells it in messages.
      value: what the caller passed.
      minimum, maximum: inclusive bounds (None: unbounded on that side).
      above, below: exclusive bounds (``above=0.0`` means strictly positive).
      allow_none: accept ``None`` (returned as is).

    Returns:
      ``float(value)``, or None when ``value`` is None and ``allow_none``.

    Raises:
      TypeError: ``value`` is not a real number.
      ValueError: ``value`` is not finite or is outside the bounds.
    """
    if value is None and allow_none:
        return None
    lows = [f">= {minimum}"] if minimum is not None else []
    lows += [f"> {above}"] if above is not None else []
    highs = [f"<= {maximum}"] if maximum is not None else []
    highs += [f"< {below}"] if below is not None else []
    expected = _expected(
        "a finite float", " and ".join(lows) or None, " and ".join(highs) or None, allow_none
    )
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise TypeError(f"{name} is {value!r}; expected {expected}")
    number = float(value)
    if (
        not math.isfinite(number)
        or (minimum is not None and number < minimum)
        or (maximum is not None and number > maximum)
        or (above is not None and number <= above)
        or (below is not None and number >= below)
    ):
        raise ValueError(f"{name} is {value!r}; expected {expected}")
    return number
