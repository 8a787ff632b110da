"""The calculator tool of :mod:`dew_pipe.tasks.tool_calc`, as a JSON-lines worker program.

Run as ``python -I -S tool_calc_worker.py "37*48="``: one episode of one problem, spoken in
the JSON-lines protocol of :class:`dew_pipe.objectives.rl.SubprocessEnvironment` (a
``reset`` request, then one ``step`` per model turn, ``get_state``/``set_state`` for
snapshots; one reply line per request). It imports only the standard library, so a worker
starts in a few milliseconds, and the task module imports the same :class:`Calculator` to
run episodes in-process: one definition of the tool, whichever side runs it.

The transcript, in the characters of :data:`ALPHABET` (ids 4 onwards; 0-3 are ``<pad>``,
``<s>``, ``</s>`` (EOS) and ``<unk>``, as :func:`dew_pipe.tasks.build_char_tokenizer` numbers
them)::

    37*48=            the first context: the problem
    #37*48</s>        a model turn that calls the calculator with an expression
    @1776             the tool's result, appended to the context (append-only: the next
                      context is the last one, the turn with its EOS, then the result)
    A1776</s>         a model turn that answers; the episode completes, detail "1776"

A turn starting with ``#`` is a call (an expression ``<digits><op><digits>`` with op one of
``+ - *``; anything else, ``?`` included, returns ``@?``), one starting with ``A`` is the final answer, and
any other turn completes the episode with a detail the verifier cannot match. A turn that
did not end on EOS is refused with an ``error`` status (the rollout never sends one).
"""

from __future__ import annotations

import base64
import json
import re
import sys

__all__ = ["ALPHABET", "EOS", "Calculator", "calculate", "decode", "encode", "main"]

ALPHABET = "0123456789+-*=#@A?"  #: ids 4 onwards, in this order
PAD, BOS, EOS, UNK = 0, 1, 2, 3
SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")
CALL, RESULT, ANSWER = "#", "@", "A"
_EXPRESSION = re.compile(r"([0-9]{1,9})([+\-*])([0-9]{1,9})")
_PROBLEM = re.compile(r"[0-9]{1,9}[+\-*][0-9]{1,9}=")


def encode(text: str) -> list[int]:
    """The ids of ``text``, one per character of :data:`ALPHABET`.

    Raises:
        ValueError: a character outside the alphabet.

    Example:
        >>> encode("12*3=")
        [5, 6, 16, 7, 17]
    """
    try:
        return [4 + ALPHABET.index(char) for char in text]
    except ValueError:
        bad = next(c for c in text if c not in ALPHABET)
        raise ValueError(f"{text!r} holds {bad!r}; expected characters of {ALPHABET!r}") from None


def decode(ids: list[int]) -> str:
    """The text of ``ids``, special ids spelled as their tokens (``</s>``...).

    Raises:
        ValueError: an id outside the vocabulary.

    Example:
        >>> decode([18, 5, 6, 2])
        '#12</s>'
    """
    out = []
    for i in ids:
        if not (isinstance(i, int) and 0 <= i < 4 + len(ALPHABET)):
            raise ValueError(f"id {i!r} is outside the vocabulary [0, {4 + len(ALPHABET)})")
        out.append(SPECIALS[i] if i < 4 else ALPHABET[i - 4])
    return "".join(out)


def calculate(expression: str) -> str:
    """The calculator: ``"37*48"`` -> ``"1776"``; ``"?"`` for anything it cannot read.

    Example:
        >>> calculate("37*48"), calculate("7-9"), calculate("3**4")
        ('1776', '-2', '?')
    """
    match = _EXPRESSION.fullmatch(expression)
    if match is None:
        return "?"
    left, op, right = int(match[1]), match[2], int(match[3])
    return str(left + right if op == "+" else left - right if op == "-" else left * right)


class Calculator:
    """One episode of the tool: the problem's context, then a reply to each turn.

    Replies are the protocol's observation objects (``context``, ``status``, ``detail``).

    Args:
        problem: the problem text, ``"<digits><op><digits>="``.

    Raises:
        ValueError: a problem of another form.

    Example:
        >>> tool = Calculator("37*48=")
        >>> tool.reset()
        {'context': [7, 11, 16, 8, 12, 17]}
        >>> tool.step(encode("#37*48") + [EOS], True)["context"][-5:] == encode("@1776")
        True
        >>> tool.step(encode("A1776") + [EOS], True)
        {'status': 'completed', 'detail': '1776'}
    """

    def __init__(self, problem: str) -> None:
        if not isinstance(problem, str) or not _PROBLEM.fullmatch(problem):
            raise ValueError(f"problem is {problem!r}; expected '<digits><op><digits>='")
        self.problem = problem
        self.context = encode(problem)
        self.calls = 0

    def reset(self) -> dict:
        """The first observation: the problem."""
        self.context, self.calls = encode(self.problem), 0
        return {"context": list(self.context)}

    def step(self, tokens: list[int], stopped: bool) -> dict:
        """The observation after one model turn (``tokens``, EOS last when ``stopped``)."""
        if not stopped or not tokens or tokens[-1] != EOS:
            return {"status": "error", "detail": "a turn must end on EOS"}
        text = decode(tokens[:-1])
        if text.startswith(CALL):
            self.calls += 1
            self.context = [*self.context, *tokens, *encode(RESULT + calculate(text[1:]))]
            return {"context": list(self.context)}
        if text.startswith(ANSWER):
            return {"status": "completed", "detail": text[1:]}
        return {"status": "completed", "detail": f"not a call or an answer: {text!r}"}

    def get_state(self) -> bytes:
        """The episode's state (context and call count) as bytes."""
        return json.dumps({"context": self.context, "calls": self.calls}).encode()

    def set_state(self, state: bytes) -> None:
        """Restores :meth:`get_state`'s bytes."""
        saved = json.loads(state)
        self.context, self.calls = [int(i) for i in saved["context"]], int(saved["calls"])


def _reply(tool: Calculator, request: dict) -> dict:
    kind = request.get("type")
    if kind == "reset":
        return tool.reset()
    if kind == "step":
        return tool.step([int(i) for i in request["tokens"]], bool(request["stopped"]))
    if kind == "get_state":
        return {"state": base64.b64encode(tool.get_state()).decode("ascii")}
    if kind == "set_state":
        tool.set_state(base64.b64decode(request["state"]))
        return {"restored": True}
    return {"error": f"unknown request type {kind!r}"}


def main(argv: list[str]) -> int:
    """Serves one episode of ``argv[1]``'s problem on stdin/stdout; returns the exit status."""
    if len(argv) != 2:
        print(f"usage: {argv[0]} PROBLEM (such as 37*48=)", file=sys.stderr)
        return 2
    tool = Calculator(argv[1])
    for line in sys.stdin:
        try:
            reply = _reply(tool, json.loads(line))
        except (ValueError, KeyError, TypeError) as error:
            reply = {"error": f"{type(error).__name__}: {error}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
