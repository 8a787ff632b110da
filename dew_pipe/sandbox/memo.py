"""`MemoFleet`: a fleet that runs each distinct program once and shares its Outcome.

A verifier scoring many completions of one policy sees the same program again and again: a
group of samples that agree, the same program written for two tasks graded on the same
cases. `MemoFleet` keys every submitted `Program` by its files, argv and stdin; the first
submission runs on the wrapped fleet, and every identical one, before or after it finishes,
gets the same Outcome without running. Sandbox time then grows with the programs a policy
invents, not with the samples it draws.

The Outcome is shared, so the memo is for programs whose Outcome depends only on those three
things: it is not for programs that read the clock, draw random numbers or race each other.
Two outcomes are never kept, because they may be the machine's doing rather than the
program's: a TIMEOUT (a loaded host can push a quick program past its wall deadline), and a
run that raised (`SandboxError`: the sandbox itself failed). The submissions that joined
such a run get its result; the next identical one runs again. The memo holds at most ``capacity`` programs, dropping the
least recently submitted finished one first.

Example:
    >>> from dew_pipe.sandbox import ProcessRunner, Program, SandboxFleet
    >>> with SandboxFleet(ProcessRunner(), workers=2) as fleet:
    ...     memo = MemoFleet(fleet)
    ...     outcomes = [memo.submit(Program({}, ["echo", "hi"])).result() for _ in range(3)]
    >>> [o.text for o in outcomes], memo.runs, memo.hits
    (['hi\\n', 'hi\\n', 'hi\\n'], 1, 2)
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import threading
from typing import Protocol

from dew_pipe._validate import check_int
from dew_pipe.sandbox.program import Outcome, Program, Verdict

__all__ = ["MemoFleet"]


class _Fleet(Protocol):
    def submit(self, program: Program) -> cf.Future[Outcome]: ...


def _key(program: Program) -> tuple:
    return (tuple(sorted(program._encoded.items())), program.argv, program.stdin)


class MemoFleet:
    """Runs each distinct program once on ``fleet``; identical ones share its Outcome.

    Args:
      fleet: a `SandboxFleet` (anything with ``submit(program)`` returning a future
        Outcome). Not closed by the memo.
      capacity: most programs remembered.

    Attributes:
      runs: programs submitted to ``fleet``.
      hits: submissions answered from the memo (or joined to a run in progress).

    TIMEOUT outcomes and sandbox failures are not kept (see the module docstring). Each
    ``submit`` returns a future of its own, so cancelling it (as `CodeReward` does
    with cases it no longer needs) never cancels the run other submissions wait on.

    Raises:
      TypeError / ValueError: a fleet without ``submit``, a capacity below 1.
    """

    def __init__(self, fleet: _Fleet, capacity: int = 65536) -> None:
        if not callable(getattr(fleet, "submit", None)):
            raise TypeError(f"fleet is {fleet!r}; expected a SandboxFleet (with submit)")
        self.fleet = fleet
        self.capacity = check_int("capacity", capacity, minimum=1)
        self.runs = self.hits = 0
        self._lock = threading.Lock()
        self._memo: collections.OrderedDict[tuple, cf.Future[Outcome]] = collections.OrderedDict()

    def submit(self, program: Program) -> cf.Future[Outcome]:
        """The future Outcome of ``program``: its own run, or the identical one's.

        Raises:
          TypeError: ``program`` is not a `Program`.
        """
        if not isinstance(program, Program):
            raise TypeError(f"program is a {type(program).__name__}; expected a Program")
        key = _key(program)
        with self._lock:
            shared = self._memo.get(key)
            fresh = shared is None
            if fresh:
                self.runs += 1
                shared = self._memo[key] = self.fleet.submit(program)
                self._trim()
            else:
                self.hits += 1
                self._memo.move_to_end(key)
        if fresh:  # outside the lock: a run already finished calls back at once
            shared.add_done_callback(lambda done: self._settle(key, done))
        mine: cf.Future[Outcome] = cf.Future()
        shared.add_done_callback(lambda done: _copy(done, mine))
        return mine

    def _settle(self, key: tuple, done: cf.Future[Outcome]) -> None:
        if done.cancelled() or done.exception() is not None or _timed_out(done.result()):
            with self._lock:
                if self._memo.get(key) is done:
                    del self._memo[key]

    def _trim(self) -> None:
        """Drops the oldest finished entries beyond capacity (running ones stay)."""
        excess = len(self._memo) - self.capacity
        for key in list(self._memo):
            if excess <= 0:
                break
            if self._memo[key].done():
                del self._memo[key]
                excess -= 1

    def __len__(self) -> int:
        with self._lock:
            return len(self._memo)

    def __repr__(self) -> str:
        return f"MemoFleet({self.fleet!r}, runs={self.runs}, hits={self.hits})"


def _timed_out(outcome: Outcome) -> bool:
    return outcome.verdict is Verdict.TIMEOUT


def _copy(done: cf.Future[Outcome], mine: cf.Future[Outcome]) -> None:
    if not mine.set_running_or_notify_cancel():
        return  # cancelled by its submitter: nobody waits for it
    if done.cancelled():
        mine.set_exception(cf.CancelledError("the shared run was cancelled"))
    elif done.exception() is not None:
        mine.set_exception(done.exception())
    else:
        mine.set_result(done.result())
