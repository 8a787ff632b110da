"""Arithmetic problems with exact integer answers: sampling, the held-out rule, answer formats.

A problem is ``left op right`` with nonnegative integer operands and ``op`` one of ``+``, ``-``,
``*``; its answer is the exact integer result (negative for a subtraction whose right operand is
larger). Its prompt is the text ``"37+485="``; its ground truth is the answer in canonical
decimal (``"522"``, ``"-448"``: an optional minus sign, no leading zeros, ``"0"`` for zero).

**Sampling.** Each operand first draws its digit count uniformly from ``[min_digits,
max_digits]``, then a value uniformly among the numbers of that many digits (``0``-``9`` for
one digit). So short operands are as common as long ones, where a uniform draw over all numbers
below ``10**max_digits`` would almost never show a one-digit operand. The operation is drawn
uniformly from the task's operations.

**Held-out rule.** Whether a problem is held out depends on the problem alone: a 64-bit hash of
``(op, left, right)``, salted with the task seed, falls below ``holdout`` of its range. Training
draws skip held-out problems and test draws keep only them, so the splits are disjoint by
construction, in every digit range alike, with no list of test problems to store or look up.
Test draws may repeat a problem (one-digit sums have few held-out members); the test accuracy is
then still an unbiased estimate over the held-out distribution.

**Answer formats.** ``"plain"``: the model writes the canonical decimal, most significant digit
first. ``"reversed"``: it writes the sign, then the digits least significant first (522 is
written ``"225"``, -448 is ``"-844"``, 100 is ``"001"``). A small decoder learns addition far
more easily in reversed order, because each digit it writes then depends only on digits it can
already see and one carry, as in written arithmetic. The ground truth is always the true answer
in canonical decimal; the checker turns a reversed completion back before comparing.

**Exact-match rule** (:func:`normalize_completion`): cut the completion at the first ``</s>``
(the EOS token's text; the text after it was never meant as answer), strip surrounding
whitespace, and, in reversed format, undo the reversal of a text made of an optional leading
``-`` and ASCII digits (the sign stays first, the digits are reversed; any other text is left
as written, and cannot match). The result must equal the ground truth character for character:
no leading zeros, no ``+`` sign, nothing else. So ``"522"``, ``" 522"`` and ``"522</s>7"`` match
``"522"`` in plain format; ``"0522"``, ``"+522"``, ``"522.0"`` and ``"522<pad>"`` do not.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np

__all__ = [
    "FORMATS",
    "OPERATIONS",
    "Problems",
    "check_operations",
    "format_answer",
    "held_out",
    "is_correct",
    "normalize_completion",
    "sample_problems",
]

OPERATIONS = ("+", "-", "*")  #: index in this tuple is the op code stored in `Problems.ops`
FORMATS = ("plain", "reversed")
EOS_TEXT = "</s>"
MAX_DIGITS = 9  # keys (op, left, right) pack into 64 bits; products stay below 2**63
_CANONICAL = re.compile(r"-?(0|[1-9][0-9]*)")
_DIGITS = re.compile(r"[0-9]+")
_HASH_RANGE = 1 << 32


def check_operations(operations: Any) -> tuple[str, ...]:
    """The operations as a tuple of distinct symbols from :data:`OPERATIONS`.

    Raises:
        TypeError: ``operations`` is not a str or a sequence of str.
        ValueError: empty, an unknown symbol, or a repeat.

    Example:
        >>> check_operations("+-")
        ('+', '-')
    """
    text = isinstance(operations, str)
    symbols = isinstance(operations, (list, tuple)) and all(isinstance(o, str) for o in operations)
    if text or symbols:
        ops = tuple(operations)
    else:
        raise TypeError(
            f"operations is {operations!r}; expected a str such as '+-' or a sequence of symbols"
        )
    if not ops:
        raise ValueError(f"operations is {operations!r}; expected at least one of {OPERATIONS}")
    for op in ops:
        if op not in OPERATIONS:
            raise ValueError(f"operations holds {op!r}; expected symbols from {OPERATIONS}")
    if len(set(ops)) != len(ops):
        raise ValueError(f"operations is {operations!r}; expected each symbol once")
    return ops


def _check_format(answer_format: Any) -> str:
    if answer_format not in FORMATS:
        raise ValueError(f"answer_format is {answer_format!r}; expected one of {FORMATS}")
    return answer_format


@dataclasses.dataclass(frozen=True)
class Problems:
    """A batch of problems as parallel arrays.

    Attributes:
        left: int64 ``[n]`` left operands (>= 0).
        right: int64 ``[n]`` right operands (>= 0).
        ops: int64 ``[n]`` operation codes, indices into :data:`OPERATIONS`.

    Example:
        >>> p = Problems(np.array([37]), np.array([485]), np.array([0]))
        >>> p.prompts(), p.ground_truths(), p.answers().tolist()
        (['37+485='], ['522'], [522])
    """

    left: np.ndarray
    right: np.ndarray
    ops: np.ndarray

    def __len__(self) -> int:
        return len(self.left)

    def answers(self) -> np.ndarray:
        """The exact results, int64 ``[n]``."""
        return np.select(
            [self.ops == 0, self.ops == 1],
            [self.left + self.right, self.left - self.right],
            self.left * self.right,
        )

    def prompts(self) -> list[str]:
        """The prompt texts, ``"<left><op><right>="``."""
        return [
            f"{a}{OPERATIONS[o]}{b}="
            for a, o, b in zip(
                self.left.tolist(), self.ops.tolist(), self.right.tolist(), strict=True
            )
        ]

    def ground_truths(self) -> list[str]:
        """The answers in canonical decimal."""
        return [str(v) for v in self.answers().tolist()]

    def targets(self, answer_format: str) -> list[str]:
        """The answers as the model is trained to write them (without the EOS token)."""
        _check_format(answer_format)
        return [format_answer(v, answer_format) for v in self.answers().tolist()]

    def keys(self) -> np.ndarray:
        """uint64 ``[n]`` keys identifying each problem: ``op * 10**18 + left * 10**9 + right``."""
        return (
            self.ops.astype(np.uint64) * np.uint64(10**18)
            + self.left.astype(np.uint64) * np.uint64(10**9)
            + self.right.astype(np.uint64)
        )

    def take(self, index: np.ndarray) -> Problems:
        """The problems at ``index`` (an int array or a bool mask)."""
        return Problems(self.left[index], self.right[index], self.ops[index])

    @staticmethod
    def concatenate(parts: list[Problems]) -> Problems:
        """All problems of ``parts``, in order."""
        return Problems(
            np.concatenate([p.left for p in parts]),
            np.concatenate([p.right for p in parts]),
            np.concatenate([p.ops for p in parts]),
        )


def format_answer(value: int, answer_format: str = "plain") -> str:
    """Spell an integer answer in ``answer_format`` (see the module docstring).

    Example:
        >>> format_answer(-448, "reversed"), format_answer(100, "reversed")
        ('-844', '001')
    """
    text = str(int(value))
    if _check_format(answer_format) == "plain":
        return text
    sign, digits = ("-", text[1:]) if text.startswith("-") else ("", text)
    return sign + digits[::-1]


def normalize_completion(completion: str, answer_format: str = "plain") -> str:
    """Apply the exact-match rule's normalization to a completion (module docstring).

    Args:
        completion: the decoded completion text.
        answer_format: ``"plain"`` or ``"reversed"``.

    Returns:
        The text cut at the first ``</s>``, stripped, and in reversed format turned back to
        most-significant-first order. It is compared verbatim with the ground truth.

    Raises:
        TypeError: ``completion`` is not a str.
        ValueError: an unknown ``answer_format``.

    Example:
        >>> normalize_completion("225</s>", "reversed"), normalize_completion(" -844", "reversed")
        ('522', '-448')
    """
    if not isinstance(completion, str):
        raise TypeError(f"completion is {type(completion).__name__}; expected the decoded text")
    text = completion.split(EOS_TEXT, 1)[0].strip()
    if _check_format(answer_format) == "reversed":
        sign, digits = ("-", text[1:]) if text.startswith("-") else ("", text)
        if _DIGITS.fullmatch(digits):  # anything else cannot match and is left as written
            text = sign + digits[::-1]
    return text


def is_correct(completion: str, ground_truth: str, answer_format: str = "plain") -> bool:
    """Whether ``completion`` states ``ground_truth`` exactly, under the documented rule.

    Args:
        completion: the decoded completion.
        ground_truth: the true answer in canonical decimal (``"522"``, ``"-448"``, ``"0"``).
        answer_format: the format the completion is written in.

    Raises:
        TypeError: a non-str completion or ground truth.
        ValueError: a ground truth that is not a canonical decimal integer, or an unknown
            format.

    Example:
        >>> is_correct("225</s>", "522", "reversed"), is_correct("0522", "522")
        (True, False)
    """
    if not isinstance(ground_truth, str):
        raise TypeError(f"ground_truth is {type(ground_truth).__name__}; expected a str")
    if not _CANONICAL.fullmatch(ground_truth) or ground_truth == "-0":
        raise ValueError(
            f"ground_truth is {ground_truth!r}; expected a canonical decimal integer such as "
            "'522' or '-448'"
        )
    return normalize_completion(completion, answer_format) == ground_truth


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a fixed bijection of uint64 that scatters nearby keys."""
    x = x.astype(np.uint64)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def held_out(problems: Problems, seed: int, holdout: float) -> np.ndarray:
    """Whether each problem belongs to the held-out split of a task with this seed.

    Args:
        problems: the problems.
        seed: the task seed (salts the hash, so another seed holds out other problems).
        holdout: the share of problems held out, in ``(0, 1)``.

    Returns:
        bool ``[n]``.

    Example:
        >>> p = Problems(np.arange(1000), np.zeros(1000, np.int64), np.zeros(1000, np.int64))
        >>> 20 < int(held_out(p, seed=0, holdout=0.05).sum()) < 80
        True
    """
    salt = _mix64(np.array([seed & (2**64 - 1)], dtype=np.uint64) ^ np.uint64(0x9E3779B97F4A7C15))
    with np.errstate(over="ignore"):
        hashed = _mix64(problems.keys() ^ salt) >> np.uint64(32)
    return hashed < np.uint64(int(holdout * _HASH_RANGE))


def sample_problems(
    rng: np.random.Generator,
    n: int,
    *,
    min_digits: int,
    max_digits: int,
    operations: tuple[str, ...],
) -> Problems:
    """Draw ``n`` problems (module docstring: digit counts uniform, then values uniform).

    Example:
        >>> p = sample_problems(np.random.default_rng(0), 4, min_digits=1, max_digits=2,
        ...                     operations=("+",))
        >>> len(p), bool((p.left < 100).all())
        (4, True)
    """
    codes = np.array([OPERATIONS.index(o) for o in operations], dtype=np.int64)
    ops = codes[rng.integers(len(codes), size=n)]
    operands = []
    for _ in range(2):
        digits = rng.integers(min_digits, max_digits + 1, size=n)
        high = 10**digits
        low = np.where(digits == 1, 0, high // 10)
        operands.append(rng.integers(low, high))
    return Problems(operands[0].astype(np.int64), operands[1].astype(np.int64), ops)
