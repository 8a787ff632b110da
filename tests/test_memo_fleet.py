"""MemoFleet: each distinct program runs once; identical ones share its Outcome.

The programs are real (ProcessRunner); a counting runner around it says how many actually
ran. The memo must key on files, argv and stdin alike, join a run in progress, keep a run
others wait on when one submitter cancels, forget a run the sandbox failed, and stay within
its capacity.
"""

from __future__ import annotations

import threading
import time

import pytest

from dew_pipe.rewards import CodeReward
from dew_pipe.sandbox import (
    MemoFleet,
    ProcessRunner,
    Program,
    SandboxError,
    SandboxFleet,
    SandboxLimits,
    Verdict,
)
from dew_pipe.sandbox import memo as memo_module

LIMITS = SandboxLimits(wall_seconds=10)


class Counting:
    """ProcessRunner, counting the programs it ran (and failing the first ``broken``)."""

    def __init__(self, broken: int = 0) -> None:
        self.runner, self.ran, self.broken = ProcessRunner(), [], broken
        self._lock = threading.Lock()

    def run(self, program, limits, directory):
        with self._lock:
            self.ran.append(program)
            if len(self.ran) <= self.broken:
                raise SandboxError("the engine is down")
        return self.runner.run(program, limits, directory)


def py(code: str, stdin: str = "") -> Program:
    return Program({"main.py": code}, ["python3", "main.py"], stdin)


def test_docstring_example_runs():
    import doctest

    result = doctest.testmod(memo_module)
    assert result.attempted > 0 and result.failed == 0


def test_identical_programs_run_once_and_any_difference_runs_again():
    runner = Counting()
    echo = "print(input() * 2)"
    programs = [
        py(echo, "ab"),
        py(echo, "ab"),
        py(echo, "cd"),  # other stdin
        py(echo + "\n", "ab"),  # other file contents
        Program({"other.py": echo}, ["python3", "other.py"], "ab"),  # other file name, argv
        Program({"main.py": echo}, ["python3", "-S", "main.py"], "ab"),  # other argv
        py(echo, "ab"),
    ]
    with SandboxFleet(runner, LIMITS, workers=2) as fleet:
        memo = MemoFleet(fleet)
        outcomes = [memo.submit(p).result() for p in programs]
    assert [o.text for o in outcomes] == ["abab\n"] * 2 + ["cdcd\n"] + ["abab\n"] * 4
    assert len(runner.ran) == memo.runs == 5 and memo.hits == 2 and len(memo) == 5


def test_submissions_join_a_run_in_progress():
    runner = Counting()
    slow = py("import time; time.sleep(0.5); print('done')")
    with SandboxFleet(runner, LIMITS, workers=4) as fleet:
        memo = MemoFleet(fleet)
        futures = [memo.submit(slow) for _ in range(4)]
        assert not any(f.done() for f in futures)
        outcomes = [f.result() for f in futures]
    assert len({id(f) for f in futures}) == 4  # each submitter has its own future
    assert [o.text for o in outcomes] == ["done\n"] * 4
    assert len(runner.ran) == 1 and (memo.runs, memo.hits) == (1, 3)


def test_a_cancelled_submission_leaves_the_shared_run_to_the_others():
    runner = Counting()
    with SandboxFleet(runner, LIMITS, workers=1) as fleet:
        memo = MemoFleet(fleet)
        blocker = fleet.submit(py("import time; time.sleep(0.5)"))  # holds the one worker
        mine = memo.submit(py("print(7)"))
        theirs = memo.submit(py("print(7)"))
        assert mine.cancel()  # still queued behind the blocker
        assert theirs.result().text == "7\n" and blocker.result().ok
    assert mine.cancelled() and len(runner.ran) == 2


def test_a_sandbox_failure_is_forgotten_and_the_next_copy_runs():
    runner = Counting(broken=1)
    with SandboxFleet(runner, LIMITS, workers=1) as fleet:
        memo = MemoFleet(fleet)
        with pytest.raises(SandboxError, match="the engine is down"):
            memo.submit(py("print(1)")).result()
        time.sleep(0.05)  # the failed run's done-callbacks have run by now
        assert len(memo) == 0
        assert memo.submit(py("print(1)")).result().text == "1\n"
    assert len(runner.ran) == 2 and memo.runs == 2


def test_failed_programs_are_remembered_like_any_outcome():
    runner = Counting()
    with SandboxFleet(runner, LIMITS, workers=1) as fleet:
        memo = MemoFleet(fleet)
        first, again = (memo.submit(py("raise SystemExit(3)")).result() for _ in range(2))
    assert first.verdict is again.verdict is Verdict.FAILED and len(runner.ran) == 1


def test_a_timeout_is_not_kept_and_the_next_copy_runs_again():
    """A loaded machine can push a quick program past its deadline: the memo keeps no TIMEOUT."""
    runner = Counting()
    with SandboxFleet(runner, SandboxLimits(wall_seconds=0.5), workers=1) as fleet:
        memo = MemoFleet(fleet)
        sleepy = py("import time; time.sleep(30)")
        first, joined = memo.submit(sleepy), memo.submit(sleepy)  # the second joins the first
        assert first.result().verdict is joined.result().verdict is Verdict.TIMEOUT
        time.sleep(0.05)
        assert len(memo) == 0
        assert memo.submit(sleepy).result().verdict is Verdict.TIMEOUT
    assert len(runner.ran) == 2 and (memo.runs, memo.hits) == (2, 1)


def test_capacity_drops_the_oldest_finished_program():
    runner = Counting()
    with SandboxFleet(runner, LIMITS, workers=1) as fleet:
        memo = MemoFleet(fleet, capacity=2)
        for code in ("print(1)", "print(2)", "print(3)"):
            memo.submit(py(code)).result()
        assert len(memo) == 2
        memo.submit(py("print(3)")).result()  # still remembered
        memo.submit(py("print(1)")).result()  # dropped: runs again
    assert [p.files["main.py"] for p in runner.ran] == ["print(1)", "print(2)", "print(3)"] + [
        "print(1)"
    ]


def test_code_reward_through_the_memo_runs_each_case_once():
    runner = Counting()
    cases = '[{"stdin": "2\\n", "stdout": "4\\n"}, {"stdin": "5\\n", "stdout": "11\\n"}]'
    completion = "```python\nprint(int(input()) * 2)\n```"
    with SandboxFleet(runner, LIMITS, workers=2) as fleet:
        reward = CodeReward(MemoFleet(fleet))
        scores = [reward("code", completion, cases, "") for _ in range(3)]
        other = reward("code", "Sure:\n" + completion, cases, "")  # same block, same runs
    assert scores == [0.5] * 3 and other == 0.5 and len(runner.ran) == 2


def test_bad_arguments_are_refused():
    with pytest.raises(TypeError, match="expected a SandboxFleet"):
        MemoFleet(object())
    with SandboxFleet(ProcessRunner(), LIMITS, workers=1) as fleet:
        with pytest.raises(ValueError, match="capacity is 0; expected an int >= 1"):
            MemoFleet(fleet, capacity=0)
        with pytest.raises(TypeError, match="program is a str; expected a Program"):
            MemoFleet(fleet).submit("print(1)")
