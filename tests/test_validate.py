"""dew_pipe._validate: the argument checks every constructor shares."""

import doctest
import math

import numpy as np
import pytest

import dew_pipe._validate as validate
from dew_pipe._validate import check_float, check_int


def test_docstring_examples():
    assert doctest.testmod(validate).failed == 0


@pytest.mark.parametrize("value", [0, 3, np.int32(3), np.int64(7), 2**40])
def test_int_accepts_integers_and_returns_python_int(value):
    result = check_int("n", value, minimum=0)
    assert result == int(value) and type(result) is int


@pytest.mark.parametrize("value", [True, False, 1.0, "3", None, np.float32(2), [1]])
def test_int_refuses_non_integers_with_type_error(value):
    with pytest.raises(TypeError, match=r"^n is .*; expected an int >= 1$"):
        check_int("n", value, minimum=1)


@pytest.mark.parametrize(
    ("value", "bounds", "expected"),
    [
        (0, {"minimum": 1}, "an int >= 1"),
        (9, {"maximum": 8}, "an int <= 8"),
        (-1, {"minimum": 0, "maximum": 8}, "an int >= 0 and <= 8"),
        (9, {"minimum": 0, "maximum": 8}, "an int >= 0 and <= 8"),
    ],
)
def test_int_out_of_range_names_value_and_bounds(value, bounds, expected):
    with pytest.raises(ValueError) as caught:
        check_int("groups", value, **bounds)
    assert str(caught.value) == f"groups is {value}; expected {expected}"


def test_int_bounds_are_inclusive():
    assert check_int("n", 1, minimum=1, maximum=1) == 1


def test_int_none_only_when_allowed():
    assert check_int("max_lag", None, minimum=0, allow_none=True) is None
    with pytest.raises(TypeError, match="expected an int >= 0"):
        check_int("max_lag", None, minimum=0)
    with pytest.raises(ValueError, match=r"^max_lag is -1; expected None or an int >= 0$"):
        check_int("max_lag", -1, minimum=0, allow_none=True)


@pytest.mark.parametrize("value", [0.5, 1, np.float32(0.25), np.int8(1)])
def test_float_accepts_reals(value):
    result = check_float("lr", value, above=0.0, maximum=1.0)
    assert result == float(value) and type(result) is float


@pytest.mark.parametrize("value", [True, "0.1", None, [0.1]])
def test_float_refuses_non_reals(value):
    with pytest.raises(TypeError, match=r"^lr is .*; expected a finite float > 0.0$"):
        check_float("lr", value, above=0.0)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, np.float64("nan")])
def test_float_refuses_non_finite(value):
    with pytest.raises(ValueError, match="expected a finite float"):
        check_float("lr", value)


@pytest.mark.parametrize(
    ("value", "bounds"),
    [
        (0.0, {"above": 0.0}),
        (1.0, {"below": 1.0}),
        (-0.1, {"minimum": 0.0}),
        (1.5, {"maximum": 1.0}),
    ],
)
def test_float_bounds(value, bounds):
    with pytest.raises(ValueError, match=r"^x is "):
        check_float("x", value, **bounds)
    # The same bound admits the value on its allowed side.
    assert check_float("x", 0.5, **bounds) == 0.5


def test_float_message_joins_both_sides():
    with pytest.raises(ValueError) as caught:
        check_float("clip", 2.0, minimum=0.0, below=1.0)
    assert str(caught.value) == "clip is 2.0; expected a finite float >= 0.0 and < 1.0"


def test_float_none_only_when_allowed():
    assert check_float("beta", None, allow_none=True) is None
    with pytest.raises(TypeError, match="expected a finite float"):
        check_float("beta", None)
