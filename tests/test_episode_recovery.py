"""EpisodeJournal: crash recovery of tool-episode collections, and what the journal refuses.

In process, with the square tool as a real worker (episode_helpers.py) and a scripted NumPy
policy: a collection interrupted mid-round resumes with equal records, the journaled draws
reused rather than sampled and each completed tool call run once (the worker's audit log);
the refusals (a second writer, a different policy at the same clocks, changed tasks,
sampling, budgets, key, clocks or topology) each name what differs and leave the journal
as it was.

With a real process (slow): a two-device training process (Trainer + EpisodeRollout +
SubprocessEnvironment + journal + checkpoints, tests/episode_recovery_worker.py) is killed
with SIGKILL before a tool call, while a tool call is pending, and between a collection's
last commit and its update; each restart resumes from its checkpoint and journal, and the
run ends with the same sampled actions and bit-identical parameters as an uninterrupted
run, while the audit log shows each completed square call once. A second writer while it
runs and a restart on another device count are refused.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import types
from pathlib import Path

import jax
import numpy as np
import pytest
from episode_helpers import live_workers, square_environment
from sandbox_helpers import alive, wait_until
from test_tool_episodes import EOS, Harness, ScriptedPolicy, episode_rollout, tasks

from dew_pipe.objectives.rl import EpisodeFailure, EpisodeJournal
from dew_pipe.objectives.rl import episode_journal as journal_module
from dew_pipe.objectives.rl.episode_journal import JournalError
from dew_pipe.sampling import Sampling

TESTS = Path(__file__).resolve().parent
KEY = jax.random.key(0)


def _state(step=4, updates=3, weights=1.0):
    return types.SimpleNamespace(
        step=np.int32(step), updates=np.int32(updates), params={"w": np.full(2, weights)}
    )


class Interrupting:
    """The factory, raising KeyboardInterrupt (a stand-in for a crash: the journal keeps the
    collection) at the ``nth`` tool call."""

    def __init__(self, factory, nth: int) -> None:
        self.factory, self.nth, self.calls = factory, nth, 0

    def __call__(self, episode_id):
        session = self.factory(episode_id)
        send = session.step

        def step(action):
            self.calls += 1
            if self.calls == self.nth:
                raise KeyboardInterrupt
            return send(action)

        session.step = step
        return session


def _audit(path: Path) -> list[str]:
    """The worker's audit lines: one JSON record (episode, call number, context) per call."""
    return path.read_text().splitlines() if path.exists() else []


def _records(episodes) -> list[tuple]:
    """Everything of the episodes but the first detail (the worker's pid)."""
    return [(e.id, e.first.context.tolist(), e.transitions, e.status, e.reward) for e in episodes]


def _collect(folder: Path, journal, policy=None, factory=None, **kw):
    folder.mkdir(exist_ok=True)
    factory = factory or square_environment(folder, AUDIT=str(folder / "audit.jsonl"))
    rollout = episode_rollout(policy or ScriptedPolicy(), factory, journal=journal, **kw)
    return rollout, rollout(_state(), tasks(2, 3), KEY)


def test_an_interrupted_collection_resumes_with_the_same_records(tmp_path):
    straight, batch = _collect(tmp_path / "straight", EpisodeJournal(tmp_path / "j0"))
    calls = _audit(tmp_path / "straight" / "audit.jsonl")
    assert len(calls) == 8  # every episode calls the square tool once

    folder = tmp_path / "crashed"
    folder.mkdir()
    worker = square_environment(folder, AUDIT=str(folder / "audit.jsonl"))
    journal = EpisodeJournal(tmp_path / "j1")
    with pytest.raises(KeyboardInterrupt):  # round 0: slots 0-4 called, slot 5 interrupted
        _collect(folder, journal, factory=Interrupting(worker, 6))
    journal.close()
    assert len(_audit(folder / "audit.jsonl")) == 5

    policy = ScriptedPolicy()
    resumed, again = _collect(folder, EpisodeJournal(tmp_path / "j1"), policy=policy)
    assert _records(resumed.last_episodes) == _records(straight.last_episodes)
    for name, column in batch.items():
        assert again[name].tobytes() == column.tobytes(), name
    assert resumed.metrics()["journal/restored_turns"] == 5
    # round 0 came from the journal: the policy drew round 1 only
    assert len(policy.contexts) == 8 and all(len(c) == 6 for c in policy.contexts)
    assert sorted(_audit(folder / "audit.jsonl")) == sorted(calls)  # each call ran once


def test_a_finished_collection_is_restored_without_opening_an_environment(tmp_path):
    journal = EpisodeJournal(tmp_path / "j")
    first, batch = _collect(tmp_path / "a", journal)
    harness = Harness()  # no snapshots: opening one would be refused
    rollout = episode_rollout(ScriptedPolicy(), harness, journal=journal)
    again = rollout(_state(), tasks(2, 3), KEY)
    assert rollout.last_episodes == first.last_episodes and not harness.environments
    assert all(again[name].tobytes() == batch[name].tobytes() for name in batch)
    assert rollout.metrics()["journal/restored_turns"] == 16


CHANGES = {
    "tasks": (dict(batch=tasks(2, 4)), "task identities: \\[2, 3\\] there, \\[2, 4\\] here"),
    "updates": (dict(state=_state(updates=2)), "training clocks"),
    "key": (dict(key=jax.random.key(1)), "the collection key"),
    "sampling": (dict(sampling=Sampling(eos_id=EOS, temperature=0.5)), "sampling controls"),
    "budgets": (dict(max_turns=2), "rollout budgets"),
    "policy": (dict(state=_state(weights=2.0)), "different policy at the same clocks"),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_another_collection_at_the_same_step_is_refused(change, tmp_path):
    journal = EpisodeJournal(tmp_path / "j")
    first, _ = _collect(tmp_path / "a", journal)
    changed, message = CHANGES[change]
    args = {"state": _state(), "batch": tasks(2, 3), "key": KEY}
    settings = {k: v for k, v in changed.items() if k not in args}
    args.update({k: v for k, v in changed.items() if k in args})
    harness = Harness()
    rollout = episode_rollout(ScriptedPolicy(), harness, journal=journal, **settings)
    with pytest.raises(JournalError, match=message) as caught:
        rollout(args["state"], args["batch"], args["key"])
    assert "step 4" in str(caught.value) and "one journal directory per run" in str(caught.value)
    assert not harness.environments  # refused before anything opened
    assert journal.steps() == [4]  # and the journal is as it was
    again = episode_rollout(ScriptedPolicy(), Harness(), journal=journal)
    assert again.collect(_state(), tasks(2, 3), KEY) == first.last_episodes


def test_another_topology_is_refused(tmp_path, monkeypatch):
    journal = EpisodeJournal(tmp_path / "j")
    _collect(tmp_path / "a", journal)
    real = journal_module.topology()
    monkeypatch.setattr(journal_module, "topology", lambda: {**real, "devices": 8})
    here = f"'devices': {real['devices']}.* there, .*'devices': 8"
    with pytest.raises(JournalError, match=f"topology: .*{here}"):
        episode_rollout(ScriptedPolicy(), Harness(), journal=journal)(_state(), tasks(2, 3), KEY)


def test_a_second_writer_is_refused(tmp_path):
    journal = EpisodeJournal(tmp_path / "j")
    journal.open()
    with pytest.raises(JournalError, match=f"held by another writer \\(pid {os.getpid()}\\)"):
        EpisodeJournal(tmp_path / "j").steps()
    journal.close()
    assert EpisodeJournal(tmp_path / "j").steps() == []  # released by close


def test_environments_without_snapshots_are_refused_only_with_a_journal(tmp_path):
    rollout = episode_rollout(ScriptedPolicy(), Harness(), journal=EpisodeJournal(tmp_path))
    with pytest.raises(EpisodeFailure, match="get_state\\(\\) and set_state\\(\\)") as caught:
        rollout(_state(), tasks(2), KEY)
    assert isinstance(caught.value.__cause__, TypeError)
    batch = episode_rollout(ScriptedPolicy(), Harness())(_state(), tasks(2), KEY)
    assert batch["response_mask"].any()


def test_a_failed_collection_is_discarded_and_sampled_again(tmp_path):
    journal = EpisodeJournal(tmp_path / "j")
    with pytest.raises(EpisodeFailure, match="killed by signal SIGSEGV"):
        _collect(tmp_path / "a", journal, factory=square_environment(tmp_path, FAULT="crash:step"))
    assert journal.steps() == []
    rollout, _ = _collect(tmp_path / "b", journal)
    assert rollout.metrics()["journal/restored_turns"] == 0


def test_a_tampered_draw_is_refused_as_another_context(tmp_path):
    folder = tmp_path / "a"
    folder.mkdir()
    journal = EpisodeJournal(tmp_path / "j")
    worker = square_environment(folder)
    with pytest.raises(KeyboardInterrupt):
        _collect(folder, journal, factory=Interrupting(worker, 2))
    journal.close()
    db = sqlite3.connect(tmp_path / "j" / "rank-00000.sqlite")
    blobs = db.execute("SELECT action FROM draws WHERE slot = 4").fetchall()
    db.execute("UPDATE draws SET action = ? WHERE slot = 1", blobs[0])  # task 3's context
    db.commit()
    db.close()
    with pytest.raises(EpisodeFailure, match="read another context"):
        _collect(folder, EpisodeJournal(tmp_path / "j"))


def test_wal_full_commits_pruning_and_a_damaged_file(tmp_path):
    journal = EpisodeJournal(tmp_path / "j")
    _collect(tmp_path / "a", journal)
    assert journal._db.execute("PRAGMA synchronous").fetchone() == (2,)  # FULL
    db = sqlite3.connect(tmp_path / "j" / "rank-00000.sqlite")
    assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    db.close()
    journal.checkpointed(5)
    assert journal.steps() == [4]  # the first checkpoint prunes nothing
    journal.checkpointed(6)
    assert journal.steps() == []  # below the previous checkpoint (5)
    journal.close()
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "rank-00000.sqlite").write_bytes(b"not a database" * 100)
    with pytest.raises(JournalError, match="rank-00000.sqlite is not a readable journal"):
        EpisodeJournal(tmp_path / "bad").steps()


def test_docstring_examples_run():
    import doctest

    failed, attempted = doctest.testmod(journal_module, raise_on_error=False)
    assert failed == 0 and attempted >= 3


# ---------------------------------------------------------------------------- a real process


def _start(run_dir: Path, kill: str, devices: int = 2, steps: int = 4) -> subprocess.Popen:
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
        PYTHONUNBUFFERED="1",
    )
    return subprocess.Popen(
        [sys.executable, str(TESTS / "episode_recovery_worker.py"), str(run_dir), str(steps), kill],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(process: subprocess.Popen, deadline: float = 240) -> tuple[int, list[dict], str]:
    try:
        out, err = process.communicate(timeout=deadline)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        raise AssertionError(f"the training process hung: {out}\n{err[-3000:]}") from None
    return process.returncode, [json.loads(line) for line in out.splitlines()], err


def _lines(run_dir: Path, kill: str, **kw) -> list[dict]:
    code, lines, err = _finish(_start(run_dir, kill, **kw))
    assert code == -9, f"expected the process to SIGKILL itself ({kill}), got {code}: {err[-3000:]}"
    return lines


@pytest.mark.slow
def test_a_killed_training_process_resumes_bit_identically(tmp_path):
    straight_dir, crashed = tmp_path / "straight", tmp_path / "crashed"
    straight_dir.mkdir()
    crashed.mkdir()
    straight = _start(straight_dir, "none")  # runs beside the crashes (two cores)

    # 1. killed before the second tool call of step 1
    first = _lines(crashed, "before:1:2")
    at_step_1 = [c for c in _audit(crashed / "audit.jsonl") if json.loads(c)["step"] == 1]
    assert first[-1]["step"] == 0 and len(at_step_1) == 1

    # 2. resumed; killed from outside while sample 1's square call at step 2 is pending
    process = _start(crashed, "during:2:1")
    paused = wait_until(lambda: (crashed / "paused").exists() or process.poll() is not None, 240)
    assert paused and process.poll() is None, "the pause at step 2 never came"
    worker = live_workers(crashed)
    assert worker
    # a second writer is refused while this one holds the journal
    refused = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from dew_pipe.objectives.rl import EpisodeJournal;"
            f"EpisodeJournal({str(crashed / 'episodes')!r}).steps()",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert f"held by another writer (pid {process.pid})" in refused.stderr
    process.kill()
    code, second, _ = _finish(process)
    assert code == -9 and second[1]["restored"] > 0
    assert wait_until(lambda: not any(alive(p) for p in worker), 10)  # workers died with it

    # 3. resumed; killed after step 3's collection returned, before its update
    third = _lines(crashed, "after:3")
    assert third[0]["resumed"] == 2 and third[1]["step"] == 2 and third[1]["restored"] > 0

    # a restart on one device is refused by the journal (topology), leaving it as it was
    code, _, err = _finish(_start(crashed, "none", devices=1))
    assert code != 0 and "topology" in err and "'devices': 2" in err

    # 4. resumed to the end
    code, fourth, err = _finish(_start(crashed, "none"))
    assert code == 0, err[-3000:]
    assert fourth[0]["resumed"] in (2, 3) and fourth[-1]["step"] == 3
    assert fourth[-1]["restored"] == sum(len(e["actions"]) for e in _actions(crashed, 3))

    code, _, err = _finish(straight)
    assert code == 0, err[-3000:]
    for step in range(4):
        assert _actions(crashed, step) == _actions(straight_dir, step), step
    ours, theirs = (np.load(d / "params.npy") for d in (crashed, straight_dir))
    assert ours.tobytes() == theirs.tobytes()
    calls = _audit(crashed / "audit.jsonl")
    assert len(calls) == len(set(calls))  # each completed square call ran once
    assert sorted(calls) == sorted(_audit(straight_dir / "audit.jsonl"))


def _actions(run_dir: Path, step: int) -> list:
    return json.loads((run_dir / "actions" / f"{step}.json").read_text())
