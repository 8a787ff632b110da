"""How many calls share a chain in recorded sessions, and why the others start a new one.

``pack`` trains each strict chain of a session as one sequence: a call joins the previous
call's chain when its prompt starts with that call's prompt and sampled ids
(:func:`~dew_pipe.objectives.rl.packing.session_chains`). Calls per chain is then what a
harness and its chat template cost: 1.0 means every turn is scored from scratch on a row of
its own. :func:`audit_sessions` measures it on recorded sessions and sorts every split by
where the new prompt first leaves the chain:

* ``"draw rewritten"``: inside the previous call's sampled ids, so history writes the turn
  differently than the model did (reasoning dropped, tool-call JSON re-serialized, an empty
  block removed: ``dew-pipe audit template`` tells which);
* ``"history rewritten"``: inside the previous call's prompt, so an earlier part of the
  conversation changed (a truncated or summarized context, a system prompt edited);
* ``"prompt shorter"``: the new prompt is a prefix of the chain (a retry, a context cut).

:func:`read_traces` reads the sessions from JSON lines, one object per line as
:func:`dew_pipe.beam.session_to_json` writes it; every line is validated like a live
``Session``, and a bad one is named by its line number.

Example:
    >>> from dew_pipe.objectives.rl.sessions import Call, Session
    >>> calls = [Call([1, 2], [3], [-0.1], "stop", 0),
    ...          Call([1, 2, 3, 7], [4], [-0.2], "stop", 0),    # extends: same chain
    ...          Call([1, 2, 3, 7, 9], [5], [-0.3], "stop", 0)]  # drops the draw 4: new chain
    >>> audit = audit_sessions([Session(0, 0, 0, 0, calls, "COMPLETED", 1.0)])
    >>> audit.calls_per_chain, audit.splits
    (1.5, {'draw rewritten': 1, 'history rewritten': 0, 'prompt shorter': 0})
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from dew_pipe._jsonl import read_objects
from dew_pipe.objectives.rl.packing import session_chains
from dew_pipe.objectives.rl.session_arrow import from_arrow
from dew_pipe.objectives.rl.session_records import Call, Session, check_sessions
from dew_pipe.rollout_batches import sessions_to_arrow

__all__ = ["SPLITS", "SessionsAudit", "audit_sessions", "read_traces"]

SPLITS = ("draw rewritten", "history rewritten", "prompt shorter")
"""The causes a split is sorted into (see the module docstring)."""

_CHUNK = 512  # lines converted per Arrow batch; a failing batch is converted line by line
_ROW_PREFIX = re.compile(r"^(sessions batch row|session) \d+: ")  # the converter's, replaced
# What the row conversion raises on a malformed session: a wrong type, a missing or bad field.
_BAD_ROW = (TypeError, ValueError, KeyError, AttributeError, pa.ArrowException)


@dataclass(frozen=True)
class SessionsAudit:
    """Calls per chain over a set of sessions.

    Attributes:
        sessions: sessions read.
        calls: calls over all sessions.
        chains: strict chains over all sessions.
        multi_call: sessions with more than one call.
        one_chain: of those, the sessions whose calls all form one chain.
        splits: calls that start a new chain after the first, by cause (see :data:`SPLITS`).
        chain_sizes: ``{calls in a chain: how many chains}``.
    """

    sessions: int
    calls: int
    chains: int
    multi_call: int
    one_chain: int
    splits: dict[str, int]
    chain_sizes: dict[int, int]

    @property
    def calls_per_chain(self) -> float:
        """Mean calls per chain (1.0: no call ever extended the previous one); NaN when
        there are no calls."""
        return self.calls / self.chains if self.chains else float("nan")

    def to_json(self) -> dict[str, Any]:
        """A plain mapping of the figures (``calls_per_chain`` included)."""
        return {
            "sessions": self.sessions,
            "calls": self.calls,
            "chains": self.chains,
            "calls_per_chain": self.calls_per_chain,
            "multi_call": self.multi_call,
            "one_chain": self.one_chain,
            "splits": dict(self.splits),
            "chain_sizes": {str(k): v for k, v in self.chain_sizes.items()},
        }

    def report(self, source: str = "sessions") -> str:
        """The figures as a few lines of text; ``source`` names what was read."""
        lines = [
            f"{source}: {self.sessions} sessions, {self.calls} calls in {self.chains} chains: "
            f"{self.calls_per_chain:.2f} calls per chain"
        ]
        lines.append(
            f"  sessions whose calls all form one chain: {self.one_chain} of "
            f"{self.multi_call} with more than one call"
        )
        total = sum(self.splits.values())
        causes = ", ".join(f"{k}: {v}" for k, v in self.splits.items() if v)
        lines.append(
            f"  calls that start a new chain: {total}" + (f" ({causes})" if causes else "")
        )
        sizes = ", ".join(f"{k}: {v}" for k, v in sorted(self.chain_sizes.items()))
        lines.append(f"  chains by calls they hold: {sizes or 'none'}")
        return "\n".join(lines)


def _split_cause(call: Call, previous: Call) -> str:
    chain = np.concatenate([previous.prompt_ids, previous.sampled_ids])
    prompt = call.prompt_ids
    n = min(chain.size, prompt.size)
    differ = np.flatnonzero(chain[:n] != prompt[:n])
    if differ.size == 0:
        return "prompt shorter"
    return "history rewritten" if differ[0] < previous.prompt_ids.size else "draw rewritten"


def audit_sessions(sessions: Sequence[Session]) -> SessionsAudit:
    """Count calls, chains and the cause of every split in ``sessions``.

    Args:
        sessions: the recorded sessions.

    Returns:
        A :class:`SessionsAudit`.

    Raises:
        TypeError: not a sequence of Session.
    """
    check_sessions(sessions)
    splits = dict.fromkeys(SPLITS, 0)
    sizes: Counter[int] = Counter()
    calls = chains = multi = one = 0
    for session in sessions:
        groups = session_chains(session.calls)
        calls += len(session.calls)
        chains += len(groups)
        sizes.update(len(g) for g in groups)
        if len(session.calls) > 1:
            multi += 1
            one += len(groups) == 1
        for group in groups[1:]:
            first = group[0]
            splits[_split_cause(session.calls[first], session.calls[first - 1])] += 1
    return SessionsAudit(len(sessions), calls, chains, multi, one, splits, dict(sizes))


def _convert(rows: list[tuple[int, dict[str, Any]]], path: str) -> list[Session]:
    try:
        return from_arrow(sessions_to_arrow([row for _, row in rows]))
    except _BAD_ROW as first:
        if len(rows) == 1:
            reason = _ROW_PREFIX.sub("", str(first).strip()) or type(first).__name__
            raise ValueError(f"{path} line {rows[0][0]}: not a valid session: {reason}") from first
    out: list[Session] = []
    for item in rows:  # one by one, so the error names the line
        out.extend(_convert([item], path))
    return out


def read_traces(path: str | os.PathLike[str]) -> list[Session]:
    """Sessions from a JSON-lines file, one :func:`dew_pipe.beam.session_to_json` object per
    line (blank lines skipped).

    Args:
        path: the ``.jsonl`` file.

    Returns:
        The sessions, in file order.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a line that is not JSON, not an object or not a valid session (the
            message names the file and the line), or a file without any session.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file; expected recorded sessions (.jsonl)")
    rows: list[tuple[int, dict[str, Any]]] = []
    sessions: list[Session] = []
    for number, row in read_objects(path):
        calls = row.get("calls")
        if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
            raise ValueError(
                f"{path} line {number}: field 'calls' is {type(calls).__name__} "
                f"{str(calls)[:40]!r}; expected a list of call objects"
            )
        rows.append((number, row))
        if len(rows) == _CHUNK:
            sessions += _convert(rows, str(path))
            rows = []
    if rows:
        sessions += _convert(rows, str(path))
    if not sessions:
        raise ValueError(f"{path} holds no sessions; expected one session object per line")
    return sessions
