"""Resume without losing in-flight rollouts: the rollout journal (dew_pipe.stages.journal).

Unit tests write and read the journal and drive the scheduler from a pre-written one: a
resumed run admits the journaled sessions within ``max_lag`` of the restored trainer
without submitting them, and resubmits (as "stale") those beyond it and those sampled from
weights the restored trainer never had, every one of them counted. The slow test kills a
real training process (a tiny GRPO run through the scheduler, with checkpoints) with
SIGKILL at a deterministic point, resumes it here, and checks that no session was admitted
twice or lost, the lag bound held and the accounting adds up.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from rollout_fakes import FakeObjective, FakeSource, FakeWeights, Outcome, task_data

from dew_pipe.batches import read_parquet, sessions_schema
from dew_pipe.data.dataset import Partition
from dew_pipe.objectives.rl import RolloutScheduler
from dew_pipe.objectives.rl.sessions import Call, Session, from_arrow
from dew_pipe.stages.journal import Entry, Journal, read_journal
from dew_pipe.training.data_stream import BatchStream

W = 16
TESTS = Path(__file__).resolve().parent


def session(task: int, sample: int, version: int, seed: int = 0, attempt: int = 0) -> Session:
    rng = np.random.default_rng(seed)
    sampled = rng.integers(1, 13, 2)
    behavior = -rng.uniform(0.1, 2.0, 2)
    call = Call([1 + task % 12], sampled, behavior, "stop", version)
    return Session(task, 100 + task, sample, attempt, [call], "COMPLETED", float(sample))


def entry(position, row, task, sample, version, seed=0, attempt=0):
    return Entry(position, row, session(task, sample, version, seed, attempt), version, 0.25)


# ----------------------------------------------------------------------------- the files


def test_journal_files_are_sessions_parquet_with_their_stamps(tmp_path):
    journal = Journal(tmp_path / "rollouts")
    written = [entry(4, 0, 8, 0, 2, seed=1), entry(4, 1, 9, 1, 1, seed=2), entry(5, 0, 10, 0, 3)]
    journal.record(written)
    files = sorted((tmp_path / "rollouts").iterdir())
    assert [f.name.split("-")[0] for f in files] == ["0000000004", "0000000005"]
    # each file is a Parquet file of the sessions schema, readable as any journal
    table = read_parquet(files[0], schema=sessions_schema())
    assert [s for rb in table.to_batches() for s in from_arrow(rb)] == [
        e.session for e in written[:2]
    ]
    assert read_journal(tmp_path / "rollouts") == written
    assert journal.counts["recorded"] == 3


def test_beam_reads_a_journal_as_recorded_sessions(tmp_path):
    import apache_beam as beam
    from apache_beam.testing.util import assert_that, equal_to

    from dew_pipe.beam import ReadSessions

    written = [entry(2, 0, 4, 0, 2, seed=1), entry(3, 1, 7, 0, 2, seed=3)]
    Journal(tmp_path).record(written)
    with beam.Pipeline("FnApiRunner") as p:
        got = p | ReadSessions(str(tmp_path / "*.parquet"))
        assert_that(got, equal_to([e.session for e in written]))


def test_an_interrupted_write_leaves_no_file_that_looks_complete(tmp_path, monkeypatch):
    import pyarrow.parquet as pq

    journal = Journal(tmp_path)
    journal.record([entry(0, 0, 1, 0, 0)])

    def killed(self, batch, *args, **kwargs):  # the process dies inside the write
        raise KeyboardInterrupt

    monkeypatch.setattr(pq.ParquetWriter, "write", killed)
    with pytest.raises(KeyboardInterrupt):
        journal.record([entry(1, 0, 2, 0, 0)])
    monkeypatch.undo()
    assert [e.position for e in read_journal(tmp_path)] == [0]
    # a .partial left by a SIGKILL (no cleanup ran) is never read, and resume removes it
    (tmp_path / "0000000001-0000-000009.parquet.partial").write_bytes(b"PAR1 half")
    assert [e.position for e in read_journal(tmp_path)] == [0]
    Journal(tmp_path).resume(0)
    assert not list(tmp_path.glob("*.partial"))


def test_a_file_that_is_not_a_journal_file_is_named(tmp_path):
    (tmp_path / "0000000003-0000-000000.parquet").write_bytes(b"not parquet")
    with pytest.raises(ValueError, match=r"journal file .*0000000003-0000-000000\.parquet"):
        Journal(tmp_path).resume(0)
    (tmp_path / "x").write_text("a file")
    with pytest.raises(NotADirectoryError, match="is a file"):
        Journal(tmp_path / "x" / "rollouts")


def test_resume_claims_each_sample_once_newest_copy_first_and_counts_the_rest(tmp_path):
    first = Journal(tmp_path)
    first.record([entry(1, 0, 2, 0, 0), entry(2, 0, 4, 0, 1, seed=1), entry(2, 0, 4, 1, 1)])
    again = Journal(tmp_path)  # a later run, resumed at 2, journals sample 0 again
    again.resume(2)
    assert again.counts["consumed"] == 1  # position 1: the restored state trained on it
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("0000000001")]
    newer = entry(2, 0, 4, 0, 1, seed=7, attempt=1)
    again.record([newer, entry(3, 0, 6, 0, 2), entry(3, 1, 99, 0, 2)])

    journal = Journal(tmp_path)
    journal.resume(2)
    assert journal.counts["superseded"] == 1 and journal.pending() == 4
    assert journal.claim(2, 0, 0, task=4).session == newer.session
    assert journal.claim(2, 0, 0, task=4) is None  # once
    assert journal.claim(2, 0, 1, task=4) is not None
    assert journal.claim(3, 1, 0, task=7) is None  # journaled for task 99 at that row
    assert journal.claim(3, 0, 0, task=6) is not None
    with pytest.warns(RuntimeWarning, match="match none of its tasks"):
        assert journal.release(3) == 1
    assert journal.counts["unmatched"] == 1 and journal.pending() == 0


def test_checkpoints_forget_what_the_previous_checkpoint_trained_on(tmp_path):
    journal = Journal(tmp_path)
    journal.record([entry(p, 0, p, 0, 0) for p in range(6)])
    journal.checkpointed(2)  # the save may still be running: forget nothing yet
    assert len(read_journal(tmp_path)) == 6
    journal.checkpointed(4)  # step 2 is on disk now
    assert [e.position for e in read_journal(tmp_path)] == [2, 3, 4, 5]


# ----------------------------------------------------------------------------- admission


@dataclasses.dataclass
class State:
    step: int
    updates: int
    params: dict


def run(sched, data, *, start: int, steps: int, version: int):
    """Hand over ``steps`` batches from data position ``start`` at trainer ``version``."""
    stream = BatchStream(sched.tasks(data), Partition(0, 1), {"consumed": start})
    for k in range(steps):
        stream.fill(1 + sched.read_ahead)
        batch = stream.next()
        state = State(start + k, version + k, {"scale": jnp.float32(1.0)})
        sched(state, batch, None)
    return stream


def test_a_resume_admits_journaled_sessions_within_max_lag_and_resubmits_the_rest(tmp_path):
    # The run resumes at position 2, trainer version 3, max_lag 1. Batch 2 (tasks 4, 5)
    # trains at version 3, batch 3 (tasks 6, 7) at version 4.
    journal = tmp_path / "rollouts"
    Journal(journal).record(
        [
            entry(1, 0, 2, 0, 1),  # trained on by the restored state: not replayed
            entry(2, 0, 4, 0, 2, seed=1),  # lag 1: admitted
            entry(2, 0, 4, 1, 2, seed=2),  # lag 1: admitted
            entry(2, 1, 5, 0, 3, seed=3),  # lag 0: admitted
            entry(2, 1, 5, 1, 1, seed=4),  # lag 2 > max_lag: resubmitted, stale
            entry(3, 0, 6, 0, 4, seed=5),  # version 4 > 3: weights the restore lost
            entry(3, 1, 99, 0, 3, seed=6),  # another task at that row: unmatched
        ]
    )
    weights = FakeWeights()
    source = FakeSource(weights)
    records = []
    sched = RolloutScheduler(
        FakeObjective(W), source, weights, width=W, rows=8, groups=2, max_lag=1, audit=True,
        journal=journal, log=records.append,
    )  # fmt: skip
    try:
        with pytest.warns(RuntimeWarning, match="match none of its tasks"):
            run(sched, task_data(8, 2), start=2, steps=2, version=3)
    finally:
        sched.close()
        source.close()

    replayed = [t for t in sched.ledger if t.replayed]
    assert len(replayed) == 5 and sched.totals["replayed"] == 5
    by_task = {(t.task, t.key[1]): t for t in replayed}
    assert {k for k, t in by_task.items() if t.outcome == "admitted"} == {(4, 0), (4, 1), (5, 0)}
    assert (by_task[(5, 1)].outcome, by_task[(5, 1)].cause) == ("resubmitted", "stale")
    assert (by_task[(6, 0)].outcome, by_task[(6, 0)].cause) == ("resubmitted", "stale")
    # the source saw only what the journal could not serve
    seen = sorted((s.task, s.sample, s.attempt) for s in source.submitted if s.task >= 4)
    assert seen == [(5, 1, 1), (6, 0, 1), (6, 1, 0), (7, 0, 0), (7, 1, 0)]
    # accounting: every submission (replays included) has one outcome, records add up
    totals = sched.totals
    outcomes = ("admitted", "resubmitted", "discarded", "cancelled", "abandoned")
    assert totals["submitted"] == sum(totals[o] for o in outcomes)
    assert totals["submitted"] == len(source.submitted) + totals["replayed"]
    assert [r.replayed for r in records] == [4, 1]
    assert all(r.accounted == r.submitted and r.lag <= 1 for r in records)
    assert [r.admitted_groups for r in records] == [2, 2]
    counts = sched.journal.counts
    assert (counts["consumed"], counts["replayed"], counts["unmatched"]) == (1, 5, 1)


# ----------------------------------------------------------------------------- SIGKILL

CHILD = """
import json, sys, threading, time
from pathlib import Path

import jax, optax

from grpo_helpers import WIDTH, tiny_decoder
from rollout_fakes import FakeSource, FakeWeights, Outcome, task_data
from test_resume_inflight import Fingerprints
from dew_pipe import Trainer
from dew_pipe.objectives.rl import GRPOObjective, RolloutScheduler
from dew_pipe.stages.journal import read_journal

run_dir = Path(sys.argv[1])

def script(s):  # the third batch (tasks 4, 5): sample 1 never finishes
    hang = s.task in (4, 5) and s.sample == 1
    return Outcome(delay=3600.0 if hang else 0.0, reward=float(s.sample))

def ready():  # checkpoint 2 on disk, batches 2 (half) and 3 (whole) journaled
    while True:
        done = (run_dir / "checkpoints" / "2" / "_CHECKPOINT_METADATA").exists()
        if done and (run_dir / "rollouts").is_dir():
            try:
                positions = [e.position for e in read_journal(run_dir / "rollouts")]
            except ValueError:  # a file pruned while we read: look again
                positions = []
            if positions.count(2) == 2 and positions.count(3) == 4:
                (run_dir / "ready").write_text("ready")
                return
        time.sleep(0.05)

threading.Thread(target=ready, daemon=True).start()
objective = GRPOObjective(tiny_decoder(), seq_len=WIDTH - 1, behavior_importance=2.0)
weights = FakeWeights()
source = FakeSource(weights, script)
scheduler = RolloutScheduler(
    objective, source, weights, width=WIDTH, rows=4, groups=2, journal=run_dir / "rollouts"
)
trainer = Trainer(
    objective, optax.adam(1e-2), key=jax.random.key(0), run_dir=run_dir, checkpoint_every=1,
    rollout=Fingerprints(scheduler, run_dir / "admitted-1.jsonl"), progress=False,
)
trainer.fit(scheduler.tasks(task_data(8, 2)), steps=6)
raise SystemExit("the run was expected to hang in batch 2 until killed")
"""


class Fingerprints:
    """The scheduler as the Trainer's rollout, writing each batch's sessions (by the bits of
    their behavior log-probabilities) to a JSON-lines file as it hands them over."""

    def __init__(self, scheduler, path: Path) -> None:
        self.scheduler, self.path = scheduler, path
        self.read_ahead = scheduler.read_ahead

    def __call__(self, state, batch, key):
        out = self.scheduler(state, batch, key)
        with self.path.open("a") as f:
            f.write(json.dumps({"step": int(state.step), "sessions": batch_prints(out)}) + "\n")
        return out

    def checkpointed(self, step: int) -> None:
        self.scheduler.checkpointed(step)


def prints(values) -> list[int]:
    return np.asarray(values, np.float32).view(np.int32).tolist()


def batch_prints(packed) -> list[list[int]]:
    """One fingerprint per session of a packed batch: its sampled ids' behavior bits."""
    out = []
    mask = packed["response_mask"] == 1
    for n in range(mask.shape[0]):
        index = packed["session_index"][n]
        for s in np.unique(index[mask[n]]):
            out.append(prints(packed["behavior_log_probs"][n][mask[n] & (index == s)]))
    return out


def admitted(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_a_run_killed_mid_stream_resumes_without_losing_or_repeating_sessions(tmp_path):
    import jax
    import optax
    from grpo_helpers import WIDTH, tiny_decoder

    from dew_pipe import Trainer
    from dew_pipe.objectives.rl import GRPOObjective

    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    )
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path)], env=env, cwd=TESTS,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while not (tmp_path / "ready").exists():
            assert child.poll() is None, child.stdout.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the child never journaled batch 2"
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)  # mid-stream: batch 2 half done, batch 3 done
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()

    # What the killed run left: every journal file complete, two batches trained on.
    journaled = [e for e in read_journal(tmp_path / "rollouts") if e.position >= 2]
    assert sorted((e.position, e.session.task, e.session.sample) for e in journaled) == [
        (2, 4, 0), (2, 5, 0), (3, 6, 0), (3, 6, 1), (3, 7, 0), (3, 7, 1),
    ]  # fmt: skip
    first = admitted(tmp_path / "admitted-1.jsonl")
    assert [line["step"] for line in first] == [0, 1]

    # Resume here, in a new scheduler on a source that finishes everything.
    objective = GRPOObjective(tiny_decoder(), seq_len=WIDTH - 1, behavior_importance=2.0)
    weights = FakeWeights()
    source = FakeSource(weights, lambda s: Outcome(reward=float(s.sample)), seed=1)
    records = []
    scheduler = RolloutScheduler(
        objective, source, weights, width=WIDTH, rows=4, groups=2, audit=True,
        journal=tmp_path / "rollouts", log=records.append,
    )  # fmt: skip
    trainer = Trainer(
        objective, optax.adam(1e-2), key=jax.random.key(0), run_dir=tmp_path,
        checkpoint_every=1, progress=False,
        rollout=Fingerprints(scheduler, tmp_path / "admitted-2.jsonl"),
    )  # fmt: skip
    try:
        state = trainer.fit(scheduler.tasks(task_data(8, 2)), steps=6)
    finally:
        scheduler.close()
        source.close()
    assert int(state.step) == 6
    second = admitted(tmp_path / "admitted-2.jsonl")
    assert [line["step"] for line in second] == [2, 3, 4, 5]

    # No session admitted twice, none lost: each batch trains G sessions per task, all
    # distinct, and every journaled session of batches 2 and 3 is among them, once.
    sessions = [tuple(s) for line in first + second for s in line["sessions"]]
    assert len(sessions) == 6 * 4 and len(set(sessions)) == len(sessions)
    replays = {tuple(prints(e.session.calls[0].behavior_log_probs)) for e in journaled}
    assert replays <= {tuple(s) for line in second[:2] for s in line["sessions"]}
    counts = scheduler.journal.counts
    assert (counts["loaded"], counts["replayed"], counts["unmatched"]) == (6, 6, 0)

    # They were not sampled again: the source saw batch 2's unfinished samples only, and
    # nothing of batch 3.
    ledger = scheduler.ledger
    groups = {t.key[0]: t for t in ledger}
    by_batch = {}
    for s in source.submitted:
        by_batch.setdefault(groups[s.group].batch, []).append((s.task, s.sample, s.attempt))
    assert sorted(by_batch[0]) == [(4, 1, 0), (5, 1, 0)]
    assert 1 not in by_batch
    assert [r.replayed for r in records] == [2, 4, 0, 0]

    # The lag bound held, and the accounting adds up over the resumed run.
    assert all(r.lag is not None and r.lag <= 1 for r in records)
    assert all(r.admitted_groups == 2 and r.accounted == r.submitted for r in records)
    totals = scheduler.totals
    outcomes = ("admitted", "resubmitted", "discarded", "cancelled", "abandoned")
    assert totals["submitted"] == sum(totals[o] for o in outcomes) == len(ledger)
    assert totals["submitted"] == len(source.submitted) + totals["replayed"]
    assert totals["admitted"] == 4 * 4 and totals["replayed"] == 6
    assert all(t.outcome == "admitted" for t in ledger if t.replayed)


@pytest.mark.slow
def test_the_pipeline_view_replays_the_journal_through_the_same_graph(tmp_path):
    import jax
    import optax
    from grpo_helpers import WIDTH, tiny_decoder

    from dew_pipe import Trainer
    from dew_pipe.objectives.rl import GRPOObjective, task_ids
    from dew_pipe.stages import TaskBatches, grpo_pipeline

    Journal(tmp_path).record(
        [entry(2, 0, 4, 0, 2, seed=1), entry(2, 1, 5, 1, 1, seed=2), entry(3, 1, 7, 0, 2, seed=3)]
    )
    objective = GRPOObjective(tiny_decoder(), seq_len=WIDTH - 1, behavior_importance=2.0)
    trainer = Trainer(objective, optax.adam(1e-2), key=jax.random.key(0), progress=False)
    resumed = dataclasses.replace(trainer.initial_state(), step=jnp.int32(2), updates=jnp.int32(2))
    weights = FakeWeights()
    source = FakeSource(weights, lambda s: Outcome(reward=float(s.sample)))
    records = []
    pipeline = grpo_pipeline(
        tasks=TaskBatches(task_data(8, 2), task_ids, start=2), source=source, weights=weights,
        trainer=trainer, score=None, width=WIDTH, rows=4, groups=2, steps=2, state=resumed,
        log=lambda step, metrics, record: records.append(record), journal=Journal(tmp_path),
    )  # fmt: skip
    pipeline.run(timeout=120)
    assert int(pipeline.stages["update"].state.step) == 4
    assert [r.replayed for r in records] == [2, 1]
    assert all(r.accounted == r.submitted and r.lag <= 1 for r in records)
    first = [(s.task, s.sample) for s in source.submitted if s.task in (4, 5, 6, 7)]
    assert sorted(first) == [(4, 1), (5, 0), (6, 0), (6, 1), (7, 1)]  # the rest replayed
