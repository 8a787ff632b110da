"""`CodeReward`: a completion's last python block run against stdin/stdout test cases.

The rules, each decided once here:

- **The program** is the body of the *last* fenced python block of the completion. Fences
  pair up as in Markdown, read line by line: a line starting with three backticks opens a
  block (indentation allowed), its first word is the language (```` ```python ````, ```` ```py ```` or
  ```` ```python3 ```` in any case make a python block), and the next line of bare backticks
  closes it. Untagged and other-language blocks are not programs (nor is a python fence
  inside one), and a block left open (a completion cut off mid-block) is not a block. A
  block indented as a whole (inside a list item) is dedented. No block: reward 0, nothing
  runs.
- **The cases** are the ground truth: a JSON list of ``{"stdin": str, "stdout": str}``
  objects, at least one. Anything else (not JSON, not a list, an empty list, a case that is
  not an object, a missing, extra or non-string field) raises `ValueError` naming the case
  and field, whether or not the completion has a block: that is a broken data set, not a
  wrong program (`PromptSource` records it as INFRA_ERROR, `SampledRollout` raises).
- **A case passes** when the program, given the case's stdin, exits 0 within the fleet's
  limits (`Verdict.COMPLETED`) and its stdout matches the expected one **line by line**:
  both are split into lines (``\\r\\n`` counts as ``\\n``), trailing spaces and tabs of
  each line are ignored, and so are blank lines at the very end (so a missing or extra final
  newline does not matter). Leading whitespace, blank lines in between and letter case all
  matter. A program that fails, hangs, crashes or floods its output fails that case: the
  fleet's Outcome says so, it never raises.
- **The reward** is the share of cases that pass, or with ``all_or_nothing=True`` 1.0 when
  every case passes and 0.0 otherwise (that mode stops at the first failing case and
  cancels the cases still queued).

Each case is one `Program`: the block written to ``main.py`` in a fresh directory and run
as ``[python, "main.py"]`` with the case's stdin, submitted to the fleet all at once so the
cases of one completion run in parallel on its workers (and several completions, scored
on `PromptSource`'s pool, share them). The fleet's runner decides the isolation: give
generated code one that isolates (`dew_pipe.sandbox.BubblewrapRunner`: no network, a
read-only job directory; or `ContainerRunner`); `ProcessRunner` keeps the machine's
filesystem and network within reach (tests/test_rewards.py shows the difference).
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import json
import textwrap
from dataclasses import dataclass
from typing import Any, Protocol

from dew_pipe.sandbox.program import Outcome, Program, Verdict

__all__ = [
    "CaseResult",
    "CodeReward",
    "Fleet",
    "TestCase",
    "last_python_block",
    "parse_cases",
    "same_output",
]

_FENCE = "```"
_PYTHON = frozenset({"python", "py", "python3"})
_FIELDS = ("stdin", "stdout")


class Fleet(Protocol):
    """What `CodeReward` needs of a `dew_pipe.sandbox.SandboxFleet`: ``submit``."""

    def submit(self, program: Program) -> cf.Future[Outcome]: ...


@dataclass(frozen=True)
class TestCase:
    """One test case: the program's stdin and the stdout it must print."""

    __test__ = False  # not a pytest class

    stdin: str
    stdout: str


@dataclass(frozen=True)
class CaseResult:
    """How one case went: the fleet's Outcome and whether the case passed."""

    case: TestCase
    outcome: Outcome
    passed: bool


def last_python_block(completion: str) -> str | None:
    """The code of the last closed fenced python block of ``completion``, or None.

    Example:
        >>> text = "```python\\nprint(1)\\n```\\nbetter:\\n```py\\nprint(2)\\n```\\n```\\nx\\n```"
        >>> last_python_block(text)
        'print(2)\\n'
        >>> last_python_block("```python\\nprint(3)") is None   # never closed
        True
    """
    found: str | None = None
    language: str | None = None  # None: outside any block
    body: list[str] = []
    for line in completion.split("\n"):  # one pass: linear in the completion's length
        line = line.rstrip("\r")
        fence = line.strip()
        if language is None:
            if fence.startswith(_FENCE):
                info = fence[len(_FENCE) :].split()
                language, body = (info[0].lower() if info else ""), []
        elif fence == _FENCE:
            if language in _PYTHON:
                found = "".join(f"{text}\n" for text in body)
            language = None
        else:
            body.append(line)
    return None if found is None else textwrap.dedent(found)


def _lines(text: str) -> list[str]:
    lines = [line.rstrip(" \t") for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def same_output(actual: str, expected: str) -> bool:
    """Whether ``actual`` matches ``expected`` line by line (the rule in the module docstring).

    Example:
        >>> same_output("4 \\n5\\n\\n", "4\\n5"), same_output(" 4", "4"), same_output("4\\n\\n5", "4\\n5")
        (True, False, False)
    """
    return _lines(actual) == _lines(expected)


def parse_cases(ground_truth: str) -> tuple[TestCase, ...]:
    """The test cases of a ground truth (a JSON list of ``{"stdin", "stdout"}`` objects).

    Raises:
        TypeError: ground_truth is not a str.
        ValueError: not JSON, not a non-empty list, or a case with a missing, extra or
            non-string field; the message names the case index and the field.

    Example:
        >>> parse_cases('[{"stdin": "2\\\\n", "stdout": "4\\\\n"}]')
        (TestCase(stdin='2\\n', stdout='4\\n'),)
    """
    if not isinstance(ground_truth, str):
        raise TypeError(f"ground_truth is {type(ground_truth).__name__}; expected a str")
    return _parse_cached(ground_truth)


@functools.lru_cache(maxsize=1024)
def _parse_cached(ground_truth: str) -> tuple[TestCase, ...]:
    expected = 'expected a JSON list of {"stdin": str, "stdout": str} test cases'
    try:
        cases = json.loads(ground_truth)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"ground_truth is not JSON ({error}): {_short(ground_truth)}; {expected}"
        ) from None
    if not isinstance(cases, list) or not cases:
        raise ValueError(f"ground_truth is {_short(cases)}; {expected}, at least one")
    parsed = []
    for i, case in enumerate(cases):
        if not isinstance(case, dict):
            raise ValueError(
                f"ground_truth[{i}] is {_short(case)}; expected an object with "
                '"stdin" and "stdout" strings'
            )
        missing = [name for name in _FIELDS if name not in case]
        extra = sorted(set(case) - set(_FIELDS))
        if missing or extra:
            problem = f"has no {missing[0]!r}" if missing else f"has unknown field {extra[0]!r}"
            raise ValueError(
                f'ground_truth[{i}] {problem}; expected exactly "stdin" and "stdout" strings'
            )
        for name in _FIELDS:
            if not isinstance(case[name], str):
                raise ValueError(
                    f"ground_truth[{i}][{name!r}] is {_short(case[name])}; expected a string"
                )
        parsed.append(TestCase(case["stdin"], case["stdout"]))
    return tuple(parsed)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class CodeReward:
    """``reward(data_source, completion, ground_truth, extra_info)``: the share of test cases
    the completion's last python block passes, run on ``fleet``.

    Args:
        fleet: a `dew_pipe.sandbox.SandboxFleet` (anything with ``submit(program)`` returning
            a future `Outcome`); its runner and limits bound every case. The reward does not
            close it.
        all_or_nothing: 1.0 only when every case passes, else 0.0 (stops at the first
            failure); False gives the fraction of cases that pass.
        python: the interpreter command, looked up on the sandbox's PATH (inside a
            container, the image's).

    How the block is found, the cases read and the output compared is the module docstring.
    ``data_source`` and ``extra_info`` are not read. Safe to call from several threads.

    Raises:
        TypeError: a fleet without ``submit``, a non-bool ``all_or_nothing``, an empty
            ``python``.
        ValueError: (when called) a ground truth that is not a list of test cases, naming
            the case and field.
        SandboxError: (when called) the fleet could not run a program at all.

    Example:
        >>> from dew_pipe.sandbox import ProcessRunner, SandboxFleet, SandboxLimits
        >>> cases = '[{"stdin": "2", "stdout": "4"}, {"stdin": "5", "stdout": "10"}]'
        >>> with SandboxFleet(ProcessRunner(), SandboxLimits(wall_seconds=10), workers=2) as fleet:
        ...     reward = CodeReward(fleet)
        ...     reward("code", "```python\\nprint(int(input()) * 2)\\n```", cases, "")
        1.0
    """

    def __init__(self, fleet: Fleet, all_or_nothing: bool = False, *, python: str = "python3"):
        if not callable(getattr(fleet, "submit", None)):
            raise TypeError(f"fleet is {fleet!r}; expected a SandboxFleet (with submit)")
        if not isinstance(all_or_nothing, bool):
            raise TypeError(f"all_or_nothing is {all_or_nothing!r}; expected a bool")
        if not isinstance(python, str) or not python:
            raise TypeError(f"python is {python!r}; expected the interpreter command (a str)")
        self.fleet, self.all_or_nothing, self.python = fleet, all_or_nothing, python

    def __call__(
        self, data_source: str, completion: str, ground_truth: str, extra_info: str, /
    ) -> float:
        cases = parse_cases(ground_truth)
        code = last_python_block(completion)
        if code is None:
            return 0.0
        results = self.check(code, cases)
        passed = sum(result.passed for result in results)
        if self.all_or_nothing:
            return 1.0 if passed == len(cases) else 0.0
        return passed / len(cases)

    def check(self, code: str, cases: tuple[TestCase, ...]) -> list[CaseResult]:
        """Runs ``code`` once per case; the results in the order the cases finished.

        Under ``all_or_nothing`` it returns at the first failing case, cancelling the
        cases not yet started (a running one finishes on its own deadline).
        """
        futures: dict[cf.Future[Outcome], TestCase] = {}
        results = []
        try:
            for case in cases:
                program = Program({"main.py": code}, [self.python, "main.py"], case.stdin)
                futures[self.fleet.submit(program)] = case
            for future in cf.as_completed(futures):
                case, outcome = futures[future], future.result()
                passed = outcome.verdict is Verdict.COMPLETED and same_output(
                    outcome.text, case.stdout
                )
                results.append(CaseResult(case, outcome, passed))
                if self.all_or_nothing and not passed:
                    break
        finally:
            for future in futures:
                future.cancel()  # no-op for the finished and the running ones
        return results

    def __repr__(self) -> str:
        return f"CodeReward({self.fleet!r}, all_or_nothing={self.all_or_nothing})"
