"""Standing fault suite, part 4: tool episodes through worker processes, and their journal.

Each case injects one fault into a SubprocessEnvironment worker (the square tool of
episode_helpers.py) or into an EpisodeJournal's directory and checks what a user relies
on: the error names the episode or the file and what happened, no worker process outlives
the failure, a failed collection leaves nothing in the journal and no checkpoint of the
step it failed in. The case that runs a whole Trainer runs in a child process with a
deadline (``fault_helpers.run_python``), so a hang fails the test instead of the suite.
"""

from __future__ import annotations

import json
import sqlite3
import sys
import time
import types
from pathlib import Path

import jax
import numpy as np
import pytest
from episode_helpers import LIMITS, live_workers, square_environment
from fault_helpers import files_under, run_python
from test_tool_episodes import ScriptedPolicy, episode_rollout, tasks

from dew_pipe.objectives.rl import (
    EpisodeFailure,
    EpisodeId,
    EpisodeJournal,
    SubprocessEnvironment,
)
from dew_pipe.objectives.rl.episode_journal import JournalError
from dew_pipe.objectives.rl.subprocess_environment import WorkerError

TESTS = Path(__file__).resolve().parent
STATE = types.SimpleNamespace(step=np.int32(1), updates=np.int32(1), params=None)
STATE_ID = EpisodeId(0, 0, 0, 0)


def test_a_hung_worker_ends_fit_on_time_with_nothing_left(tmp_path):
    code = f"""
import itertools, json, sys, time
sys.path[:0] = [{str(TESTS)!r}]
from pathlib import Path
import jax, optax
from episode_helpers import live_workers, square_environment
from test_tool_episodes import BUDGET, PROMPT, SAMPLING, TURNS, ScriptedPolicy, ToolPolicy
from test_tool_episodes import tasks, verify
from dew_pipe import Dataset, Trainer
from dew_pipe.objectives.rl import EpisodeFailure, EpisodeJournal, EpisodeRollout
from dew_pipe.objectives.rl import GRPOObjective
from dew_pipe.sandbox import SandboxLimits
run = Path(sys.argv[1])
factory = square_environment(run, SandboxLimits(wall_seconds=1.5), FAULT="hang:step")
rollout = EpisodeRollout(ScriptedPolicy(), factory, verify, max_prompt_tokens=PROMPT,
                         max_new_tokens=BUDGET, max_turns=TURNS, groups=2, sampling=SAMPLING,
                         journal=EpisodeJournal(run / "episodes"))
trainer = Trainer(GRPOObjective(ToolPolicy(), seq_len=PROMPT + BUDGET - 1), optax.sgd(0.5),
                  key=jax.random.key(5), rollout=rollout, run_dir=run, checkpoint_every=1,
                  progress=False)
data = Dataset(train=lambda partition: itertools.repeat(tasks(2, 3)), val=None, batch=2)
start = time.monotonic()
try:
    trainer.fit(data, steps=2, log_every=1)
except EpisodeFailure as error:
    print(json.dumps({{"error": str(error), "seconds": time.monotonic() - start,
                      "workers": live_workers(run), "journal": rollout.journal.steps()}}))
"""
    result = run_python(code, str(tmp_path), deadline=90)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.splitlines()[-1])
    assert "episode (task 2, step 0, sample 0" in report["error"]
    assert "gave no reply to step within the session's wall-clock deadline" in report["error"]
    assert report["seconds"] < 30 and report["workers"] == [] and report["journal"] == []
    checkpoints = files_under(tmp_path / "checkpoints")
    assert not [p for p in checkpoints if p.split("/")[0].isdigit()]  # no step was saved


COHORT_FAULTS = {
    "crash": ("crash:step", "killed by signal SIGSEGV"),
    "memory": ("memory:step", "MemoryError"),
    "garbage": ("garbage:reset", "a line that is not JSON"),
    "exit": ("exit:reset", "exited with status 3"),
}


@pytest.mark.parametrize("case", sorted(COHORT_FAULTS))
def test_a_failing_worker_aborts_the_cohort_naming_it_and_stops_every_worker(case, tmp_path):
    fault, message = COHORT_FAULTS[case]
    journal = EpisodeJournal(tmp_path / "episodes")
    rollout = episode_rollout(
        ScriptedPolicy(), square_environment(tmp_path, FAULT=fault), journal=journal
    )
    with pytest.raises(EpisodeFailure, match=message) as caught:
        rollout(STATE, tasks(2), jax.random.key(0))
    assert isinstance(caught.value.__cause__, WorkerError)
    assert "episode (task 2, step 1, sample 0" in str(caught.value)
    assert live_workers(tmp_path) == [] and journal.steps() == []


def test_a_command_that_cannot_run_is_named(tmp_path):
    factory = SubprocessEnvironment(["no-such-worker", "--serve"], LIMITS)
    rollout = episode_rollout(ScriptedPolicy(), factory)
    with pytest.raises(EpisodeFailure, match="status 127.*cannot execute 'no-such-worker'"):
        rollout(STATE, tasks(2), jax.random.key(0))


WORKERS = {
    # closes its stdout and runs on: the parent must not wait for it forever
    "silent": "import os, sys, time\nsys.stdin.readline()\nos.close(1)\ntime.sleep(60)\n",
    # floods stderr before every reply: a pipe nobody drains would block it
    "chatty": (
        "import json, sys\nfor line in sys.stdin:\n"
        "    sys.stderr.write('x' * 300_000)\n    sys.stderr.flush()\n"
        "    print(json.dumps({'context': [2, 5]}), flush=True)\n"
    ),
}


def _worker(tmp_path: Path, name: str) -> SubprocessEnvironment:
    (tmp_path / f"{name}.py").write_text(WORKERS[name])
    return SubprocessEnvironment([sys.executable, str(tmp_path / f"{name}.py")], LIMITS)


def test_a_worker_that_closes_its_stdout_is_stopped(tmp_path):
    start = time.monotonic()
    with _worker(tmp_path, "silent")(STATE_ID) as env:
        with pytest.raises(WorkerError, match="ended before replying to reset: it closed its"):
            env.reset()
        assert env._launched._process.poll() is not None
    assert time.monotonic() - start < 20


def test_a_worker_flooding_its_stderr_still_answers(tmp_path):
    with _worker(tmp_path, "chatty")(STATE_ID) as env:
        for _ in range(3):
            assert env.reset().context.tolist() == [2, 5]


def test_a_journal_path_that_is_a_file_is_refused_naming_it(tmp_path):
    (tmp_path / "episodes").write_text("not a folder")
    rollout = episode_rollout(
        ScriptedPolicy(),
        square_environment(tmp_path),
        journal=EpisodeJournal(tmp_path / "episodes"),
    )
    with pytest.raises(JournalError, match="cannot open .*episodes/rank-00000.lock"):
        rollout(STATE, tasks(2), jax.random.key(0))
    assert live_workers(tmp_path) == []  # refused before any worker started


def test_a_journal_of_another_format_is_refused(tmp_path):
    journal = EpisodeJournal(tmp_path)
    journal.steps()
    journal.close()
    db = sqlite3.connect(tmp_path / "rank-00000.sqlite")
    db.execute("UPDATE meta SET value = '99' WHERE name = 'format'")
    db.commit()
    db.close()
    for _ in range(2):  # the second time too: a refused open released its lock
        with pytest.raises(JournalError, match="journal format 99; expected 1"):
            EpisodeJournal(tmp_path).steps()
