"""`MathReward`: the last ``\\boxed{...}`` answer of a completion against an exact rational.

Strategy, in three steps, each with its own rule:

1. **The answer** is the argument of the *last* ``\\boxed`` in the completion, read with
   brace matching (nested groups such as ``\\boxed{\\frac{1}{2}}`` are whole; ``\\{`` and
   ``\\}`` are literal braces and do not count). Earlier boxes are drafts: only the last one
   is graded, and when it is malformed (no braced argument, unbalanced, empty) the
   completion scores 0 rather than falling back to an earlier box.
2. **Parsing** is `latex2sympy2_extended` (the LaTeX-to-SymPy converter that Hugging Face's
   Math-Verify is built on), with its normalizations for answers: ``\\dfrac12`` and
   ``\\frac12`` read as ``\\frac{1}{2}``, ``\\left( \\right)`` and ``\\displaystyle`` are
   dropped, a trailing unit such as ``5 \\text{ cm}`` is dropped, ``1,000`` (comma-separated
   groups of exactly three digits) is one thousand while ``1,5`` is a set of two numbers,
   ``50\\%`` is ``50/100``, ``x = 5`` answers 5. We use the converter rather than
   Math-Verify's ``parse``/``verify`` because ``verify`` compares numbers with a float
   tolerance (0.333 would pass for 1/3) and ``parse`` times itself out with ``SIGALRM``,
   which only works on the main thread, while `PromptSource` scores on a pool.
3. **The comparison is exact**: the parsed expression is evaluated to a
   `fractions.Fraction` by :func:`rational_value`, which accepts integers, fractions,
   decimals (a decimal is the number written, ``0.333`` is 333/1000), sums, products,
   integer powers and roots that come out rational (``\\sqrt{4}`` is 2), and nothing else.
   So ``0.5``, ``1/2``, ``\\frac{1}{2}``, ``\\dfrac12`` and ``2^{-1}`` all agree, while
   ``0.333`` and ``1/3`` do not; ``\\sqrt{2}``, ``\\pi``, a variable or a set is not a
   rational and scores 0. There is no float anywhere in the comparison.

A completion whose answer does not parse scores 0, never raises; a *reference* that is not
a rational number raises `ValueError` naming it, because that is a broken data set, not a
wrong answer (`PromptSource` records it as INFRA_ERROR, `SampledRollout` raises).

Bounds that keep a hostile completion cheap: an answer longer than ``MAX_ANSWER_CHARS`` is
not parsed, and a power or root whose exact value would need more than ``MAX_BITS`` bits
(``10^{10^{10}}``) is not evaluated; both score 0. The ANTLR runtime behind the converter
shares its parse caches between threads without locking, so parsing holds a module lock
(a parse takes about a millisecond).
"""

from __future__ import annotations

import functools
import threading
from fractions import Fraction
from typing import Any

__all__ = [
    "MAX_ANSWER_CHARS",
    "MAX_BITS",
    "MathReward",
    "last_boxed",
    "parse_rational",
    "rational_value",
]

#: Answers longer than this many characters are not parsed (the completion scores 0).
MAX_ANSWER_CHARS = 1000
#: The most bits a power's or root's exact numerator or denominator may take (about 3,000
#: decimal digits); beyond it the answer is not evaluated and scores 0.
MAX_BITS = 10_000
#: The largest root index evaluated exactly (``x^{1/q}``, ``\\sqrt[q]{x}``).
_MAX_ROOT = 64

_BOXED = "\\boxed"
_PARSE_LOCK = threading.Lock()


def last_boxed(text: str) -> str | None:
    """The argument of the last ``\\boxed{...}`` in ``text``, or None.

    None when there is no ``\\boxed``, or when the last one is malformed: no braced
    argument, braces that never close, or an empty argument.

    Example:
        >>> last_boxed(r"first \\boxed{1}, then \\boxed{\\frac{1}{2}}.")
        '\\\\frac{1}{2}'
        >>> last_boxed(r"\\boxed{3} and \\boxed{\\frac{1}{2}") is None
        True
    """
    start = text.rfind(_BOXED)
    while start >= 0 and text[start + len(_BOXED) : start + len(_BOXED) + 1].isalpha():
        start = text.rfind(_BOXED, 0, start)  # \boxedx is another command
    if start < 0:
        return None
    i = start + len(_BOXED)
    while i < len(text) and text[i].isspace():
        i += 1
    if i >= len(text) or text[i] != "{":
        return None
    depth, j = 0, i
    while j < len(text):
        char = text[j]
        if char == "\\":
            j += 2  # an escaped character (\{, \}, \\) is never a group brace
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                answer = text[i + 1 : j].strip()
                return answer or None
        j += 1
    return None


def parse_rational(latex: str) -> Fraction | None:
    """The exact value of a LaTeX or plain answer, or None when it is not a rational number.

    None also when the answer is malformed, longer than `MAX_ANSWER_CHARS`, or needs more
    than `MAX_BITS` bits to evaluate. Never raises for a string.

    Example:
        >>> [parse_rational(s) for s in ["0.5", "1/2", r"\\dfrac12", "-3", "1,000"]]
        [Fraction(1, 2), Fraction(1, 2), Fraction(1, 2), Fraction(-3, 1), Fraction(1000, 1)]
        >>> parse_rational("0.333") == Fraction(1, 3), parse_rational(r"\\sqrt{2}")
        (False, None)
    """
    if not isinstance(latex, str):
        raise TypeError(f"answer is {type(latex).__name__}; expected a str")
    latex = latex.strip()
    if not latex or len(latex) > MAX_ANSWER_CHARS:
        return None
    return _parse_cached(latex)


@functools.lru_cache(maxsize=4096)
def _parse_cached(latex: str) -> Fraction | None:
    from latex2sympy2_extended import latex2sympy  # sympy + ANTLR: about 1 s to import

    with _PARSE_LOCK:
        try:
            expr = latex2sympy(latex, normalization_config=_normalization())
        except Exception:  # noqa: BLE001 - any parse failure is "not an answer"
            return None
        try:
            return rational_value(expr)
        except (ArithmeticError, ValueError, TypeError):  # 1/0 and the like
            return None


@functools.cache
def _normalization() -> Any:
    from latex2sympy2_extended.math_normalization import NormalizationConfig

    # basic_latex: \left, \displaystyle, \text wrappers; units: "5 \text{ cm}" -> 5;
    # malformed_operators: \frac12 -> \frac{1}{2}, \sqrt2 -> \sqrt{2}; nits: ".5" -> "0.5".
    # boxed="none": the box was taken off already, by last_boxed's own rule.
    return NormalizationConfig(
        basic_latex=True, units=True, malformed_operators=True, nits=True, boxed="none"
    )


def rational_value(expr: Any) -> Fraction | None:
    """The exact rational value of a SymPy expression built from numbers, or None.

    Accepted: integers and rationals; floats, read as the decimal they were written as
    (their ``str``, which carries every written digit); sums and products; powers whose
    exponent is rational, when the result is rational and fits `MAX_BITS`; an equation
    ``symbol = value`` (its value). Anything else (symbols, constants such as pi, sets,
    infinities, functions) is None.

    Example:
        >>> import sympy
        >>> rational_value(sympy.Add(sympy.Float("0.1"), sympy.Float("0.2"), evaluate=False))
        Fraction(3, 10)
    """
    import sympy

    if isinstance(expr, sympy.UnevaluatedExpr):
        return rational_value(expr.args[0])
    if getattr(expr, "is_Rational", False):
        return Fraction(int(expr.p), int(expr.q))
    if getattr(expr, "is_Float", False):
        return Fraction(str(expr))  # ValueError for nan/inf: not an answer
    if isinstance(expr, sympy.Equality) and getattr(expr.lhs, "is_Symbol", False):
        return rational_value(expr.rhs)
    if getattr(expr, "is_Add", False) or getattr(expr, "is_Mul", False):
        values = [rational_value(arg) for arg in expr.args]
        if any(v is None for v in values):
            return None
        total = Fraction(0) if expr.is_Add else Fraction(1)
        for value in values:
            total = total + value if expr.is_Add else total * value
        return total
    if getattr(expr, "is_Pow", False):
        base, exponent = (rational_value(arg) for arg in expr.args)
        if base is None or exponent is None:
            return None
        return _power(base, exponent)
    return None


def _power(base: Fraction, exponent: Fraction) -> Fraction | None:
    """``base ** exponent`` exactly, or None when irrational, undefined or too large."""
    from sympy import integer_nthroot

    if exponent.denominator > _MAX_ROOT:
        return None
    size = max(base.numerator.bit_length(), base.denominator.bit_length())
    if size * abs(exponent.numerator) > MAX_BITS:
        return None
    if base == 0:
        return None if exponent <= 0 else Fraction(0)
    root = exponent.denominator
    if root > 1:
        if base < 0 and root % 2 == 0:
            return None  # an even root of a negative number is not real
        num, num_exact = integer_nthroot(abs(base.numerator), root)
        den, den_exact = integer_nthroot(base.denominator, root)
        if not (num_exact and den_exact):
            return None  # irrational: \sqrt{2}
        base = Fraction(-num if base < 0 else num, den)
    return base**exponent.numerator


class MathReward:
    """``reward(data_source, completion, ground_truth, extra_info)``: 1.0 when the last
    ``\\boxed{}`` answer equals the reference exactly as a rational number, else 0.0.

    The reference (``ground_truth``) is the answer itself in LaTeX or plain text (``3``,
    ``-0.5``, ``1/2``, ``\\frac{1}{2}``; a ``\\boxed{...}`` around it is taken off). How the
    answer is found, parsed and compared, and what each form means, is the module's
    docstring. ``data_source`` and ``extra_info`` are not read. Safe to call from several
    threads at once (PromptSource's pool).

    Raises:
        ValueError: the reference is not a rational number (naming it).

    Example:
        >>> reward = MathReward()
        >>> reward("math", r"so the answer is \\boxed{\\dfrac{1}{2}}", "0.5", "")
        1.0
        >>> reward("math", r"\\boxed{0.333}", r"\\frac{1}{3}", ""), reward("math", "1/2", "1/2", "")
        (0.0, 0.0)
    """

    def __call__(
        self, data_source: str, completion: str, ground_truth: str, extra_info: str, /
    ) -> float:
        reference = self.reference(ground_truth)
        answer = last_boxed(completion)
        if answer is None:
            return 0.0
        return 1.0 if parse_rational(answer) == reference else 0.0

    @staticmethod
    def reference(ground_truth: str) -> Fraction:
        """The reference's exact value; `ValueError` naming it when it is not a rational."""
        if not isinstance(ground_truth, str):
            raise TypeError(f"ground_truth is {type(ground_truth).__name__}; expected a str")
        boxed = last_boxed(ground_truth) if _BOXED in ground_truth else None
        value = parse_rational(ground_truth if boxed is None else boxed)
        if value is None:
            raise ValueError(
                f"ground_truth is {ground_truth!r}; expected a rational number such as 3, "
                "-0.5, 1/2 or \\frac{1}{2} (MathReward compares answers exactly)"
            )
        return value

    def __repr__(self) -> str:
        return "MathReward()"
