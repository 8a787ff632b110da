"""Small stdin/stdout programs specified by examples: the operations, their reference programs,
the examples a prompt shows and the hidden test cases that grade a program.

Every program of the family reads one line of space-separated integers from stdin and prints
one line. An **operation** is one such function; its reference program is a *reader* line
that parses the input and a print line that computes the answer::

    a=[*map(int,input().split())]
    print(sum(a))

A **task** shows a few input/output examples of one operation (the prompt,
``"5 2 9>16\n3 1>4\n7 0 2 7>16\n"``) and asks for a program. Its examples are drawn until
they rule out every *other* operation of the task's family (for each, some example on which
it prints something else), so exactly one operation fits and a perfect policy passes every
task. Example inputs hold ``min_length`` to ``max_length`` integers of one digit.

**Two readers.** :data:`READERS` holds two ways to parse the input line: ``"split"`` (split
on whitespace, any number of digits per integer) and ``"digits"`` (one integer per digit
character). Both read every prompt's examples right, since those hold one-digit numbers;
only ``"split"`` reads the hidden cases right.

**Hidden cases.** A task's ground truth is :class:`~dew_pipe.rewards.CodeReward`'s JSON list
of ``{"stdin", "stdout"}`` cases: the operation on a fixed *battery* of inputs, the same for
every task of a seed, drawn once from the seed: integers of up to two digits, each input
holding at least one of two digits (which the examples never show, as hidden tests often
cover what the examples do not), redrawn until every two operations of :data:`OPERATIONS`
print something different on at least one input. So a program passes all cases only if it
reads whole numbers and agrees with the task's operation wherever the battery can tell them
apart, and the cases never appear in a prompt. Sharing the battery across tasks is what lets
a job run each distinct program once per case (:class:`~dew_pipe.sandbox.MemoFleet`): the
same program written for two tasks of one operation is the same sandbox run.

**Held-out rule.** A task is held out when a 64-bit hash of its prompt text, salted with the
seed, falls below ``holdout`` of its range: the splits are disjoint by construction, and a
test prompt is never trained on (training draws skip held-out prompts).

Example:
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> task = draw_task(rng, "max", ("sum", "max", "min"), examples=2, lengths=(2, 4))
    >>> OPERATIONS["max"].run([3, 19, 4]), task.operation
    ('19', 'max')
    >>> print(reference_program("sum"), end="")
    a=[*map(int,input().split())]
    print(sum(a))
    >>> print(reference_program("sum", reader="digits"), end="")
    a=[int(c) for c in input() if c!=' ']
    print(sum(a))
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
from collections.abc import Callable, Sequence

import numpy as np

__all__ = [
    "DEFAULT_OPERATIONS",
    "OPERATIONS",
    "Operation",
    "ProgramTask",
    "battery",
    "check_operations",
    "draw_task",
    "ground_truth",
    "held_out",
    "prompt_text",
    "READERS",
    "reference_program",
]

READERS = {  #: the first line of a reference program: how it parses the input
    "split": "a=[*map(int,input().split())]\n",
    "digits": "a=[int(c) for c in input() if c!=' ']\n",
}
BATTERY_VALUES = 100  # hidden inputs hold integers below this (the examples: below 10)


def _spaced(values: Sequence[int]) -> str:
    return " ".join(map(str, values))


@dataclasses.dataclass(frozen=True)
class Operation:
    """One function of the family: its name, the line that prints it, and the function.

    Attributes:
      name: the operation's name (what ``extra_info`` records; never shown to the model).
      line: the reference program's second line (after its reader line).
      function: ``list[int] -> str``, the line the program prints (without its newline).
    """

    name: str
    line: str
    function: Callable[[list[int]], str]

    def run(self, values: Sequence[int]) -> str:
        """What the reference program prints for ``values``, without the newline."""
        return self.function(list(values))

    def program(self, reader: str = "split") -> str:
        """The reference program's text, reading the input with ``READERS[reader]``."""
        return f"{READERS[reader]}{self.line}\n"


OPERATIONS: dict[str, Operation] = {
    op.name: op
    for op in (
        Operation("sum", "print(sum(a))", lambda a: str(sum(a))),
        Operation("max", "print(max(a))", lambda a: str(max(a))),
        Operation("min", "print(min(a))", lambda a: str(min(a))),
        Operation("len", "print(len(a))", lambda a: str(len(a))),
        Operation("first", "print(a[0])", lambda a: str(a[0])),
        Operation("last", "print(a[-1])", lambda a: str(a[-1])),
        Operation("sorted", "print(*sorted(a))", lambda a: _spaced(sorted(a))),
        Operation("reversed", "print(*a[::-1])", lambda a: _spaced(a[::-1])),
        Operation("range", "print(max(a)-min(a))", lambda a: str(max(a) - min(a))),
        Operation("double", "print(*[x*2 for x in a])", lambda a: _spaced([2 * x for x in a])),
        Operation("distinct", "print(len(set(a)))", lambda a: str(len(set(a)))),
        Operation("evens", "print(*[x for x in a if x%2==0])", lambda a: _spaced(
            [x for x in a if x % 2 == 0])),
    )
}  # fmt: skip
# The default family: operations a decoder of ~0.1 M parameters learns to tell apart from
# three examples in a few hundred SFT steps (first and last take it far longer: they only
# differ from max and min by where the answer sits in the input).
DEFAULT_OPERATIONS = ("sum", "max", "min", "len", "sorted", "reversed")
MAX_TRIES = 1000  # example draws before a task is declared impossible to disambiguate


def check_operations(operations: object) -> tuple[str, ...]:
    """The operation names as a tuple, each known and at most once; at least two.

    Accepts a sequence of names or one comma-separated str (``"sum,max,min"``).

    Raises:
      TypeError: neither a str nor a sequence of str.
      ValueError: fewer than two, an unknown name, or a repeat.

    Example:
      >>> check_operations("sum,max")
      ('sum', 'max')
    """
    if isinstance(operations, str):
        names = tuple(name.strip() for name in operations.split(","))
    elif isinstance(operations, Sequence) and all(isinstance(n, str) for n in operations):
        names = tuple(operations)
    else:
        raise TypeError(
            f"operations is {operations!r}; expected names such as 'sum,max,min' or a sequence"
        )
    for name in names:
        if name not in OPERATIONS:
            raise ValueError(f"operations holds {name!r}; expected names from {tuple(OPERATIONS)}")
    if len(set(names)) != len(names):
        raise ValueError(f"operations is {operations!r}; expected each name once")
    if len(names) < 2:
        raise ValueError(
            f"operations is {operations!r}; expected at least two (one operation needs no "
            "examples to tell it apart)"
        )
    return names


def reference_program(name: str, reader: str = "split") -> str:
    """The reference program of operation ``name``: a reader line, then its print line."""
    return OPERATIONS[name].program(reader)


@dataclasses.dataclass(frozen=True)
class ProgramTask:
    """One task: an operation and the examples its prompt shows.

    Attributes:
      operation: the operation's name.
      examples: the example inputs, each a tuple of ints.
    """

    operation: str
    examples: tuple[tuple[int, ...], ...]

    @property
    def prompt(self) -> str:
        """The prompt text (:func:`prompt_text`)."""
        return prompt_text(self.operation, self.examples)


def prompt_text(operation: str, examples: Sequence[Sequence[int]]) -> str:
    """One line per example, ``"<input>><output>\\n"``: ``"5 2 9>16\\n"`` for sum."""
    op = OPERATIONS[operation]
    return "".join(f"{_spaced(x)}>{op.run(x)}\n" for x in examples)


def _inputs(
    rng: np.random.Generator, n: int, lengths: tuple[int, int], values: int = 10
) -> list[tuple[int, ...]]:
    sizes = rng.integers(lengths[0], lengths[1] + 1, size=n)
    return [tuple(rng.integers(0, values, size=int(k)).tolist()) for k in sizes]


def _tells_apart(a: Operation, b: Operation, inputs: Sequence[Sequence[int]]) -> bool:
    return any(a.run(x) != b.run(x) for x in inputs)


def draw_task(
    rng: np.random.Generator,
    operation: str,
    family: Sequence[str],
    *,
    examples: int,
    lengths: tuple[int, int],
) -> ProgramTask:
    """A task of ``operation`` whose examples rule out every other operation of ``family``.

    Raises:
      ValueError: no draw of ``MAX_TRIES`` told the operations apart (too few examples or
        too short inputs for this family; two operations that always agree).
    """
    target = OPERATIONS[operation]
    others = [OPERATIONS[name] for name in family if name != operation]
    for _ in range(MAX_TRIES):
        drawn = _inputs(rng, examples, lengths)
        if all(_tells_apart(target, other, drawn) for other in others):
            return ProgramTask(operation, tuple(drawn))
    raise ValueError(
        f"no {examples} examples of lengths {lengths} told {operation!r} apart from the "
        f"other operations {[o.name for o in others]} in {MAX_TRIES} draws; expected more "
        "examples or longer inputs"
    )


def battery(seed: int, size: int, lengths: tuple[int, int]) -> tuple[tuple[int, ...], ...]:
    """The hidden inputs of a seed: ``size`` inputs on which every two operations differ.

    Integers below :data:`BATTERY_VALUES`, each input holding one of two digits at least;
    drawn from ``(seed, "battery")`` until every pair of :data:`OPERATIONS` prints something
    different on at least one input, so the battery grades any family the same way.

    Raises:
      ValueError: no draw of ``MAX_TRIES`` separated every pair (``size`` too small).

    Example:
      >>> len(battery(0, 4, (2, 5)))
      4
    """
    rng = np.random.default_rng([seed, 0xBA77])
    for _ in range(MAX_TRIES):
        inputs = _inputs(rng, size, lengths, BATTERY_VALUES)
        pairs = itertools.combinations(OPERATIONS.values(), 2)
        wide = all(max(x) >= 10 for x in inputs)  # the digit reader misreads every input
        if wide and all(_tells_apart(a, b, inputs) for a, b in pairs):
            return tuple(inputs)
    raise ValueError(
        f"no battery of {size} inputs of lengths {lengths} told every two operations apart "
        f"in {MAX_TRIES} draws; expected a larger battery"
    )


def ground_truth(operation: str, inputs: Sequence[Sequence[int]]) -> str:
    """CodeReward's ground truth: the JSON cases of ``operation`` on ``inputs``.

    Example:
      >>> ground_truth("sum", [(1, 2)])
      '[{"stdin": "1 2\\\\n", "stdout": "3\\\\n"}]'
    """
    op = OPERATIONS[operation]
    cases = [{"stdin": f"{_spaced(x)}\n", "stdout": f"{op.run(x)}\n"} for x in inputs]
    return json.dumps(cases)


def held_out(prompt: str, seed: int, holdout: float) -> bool:
    """Whether the task with this prompt is in the held-out split of a seed's task.

    Example:
      >>> prompts = [f"{i}>{i}\\n" for i in range(2000)]
      >>> 50 < sum(held_out(p, 0, 0.05) for p in prompts) < 150
      True
    """
    digest = hashlib.blake2b(f"{seed}\0{prompt}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") < holdout * 2**64
