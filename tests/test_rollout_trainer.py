"""A Trainer run through RolloutScheduler on a tiny decoder and a fake source: the batch the
update trains on carries old_log_probs rescored under the state's own weights, weights are
pushed as the trainer moves, and a resumed fit cancels and resubmits what was in flight."""

import jax
import numpy as np
import optax
import pytest
from grpo_helpers import WIDTH, tiny_decoder
from rollout_fakes import FakeSource, FakeWeights, Outcome, task_data

from dew_pipe import Trainer
from dew_pipe.objectives.rl import GRPOObjective, RolloutScheduler


class Checked:
    """Wraps the scheduler as the Trainer's rollout and records what it handed back,
    with the objective's own scoring of that batch under the state's live weights."""

    def __init__(self, scheduler, objective):
        self.scheduler, self.objective = scheduler, objective
        self.score = jax.jit(objective.packed_log_probs)
        self.read_ahead = scheduler.read_ahead
        self.seen = []

    def __call__(self, state, batch, key):
        out = self.scheduler(state, batch, key)
        expected = np.asarray(self.score(state.params, out))
        self.seen.append((int(state.updates), out, expected))
        return out

    def metrics(self):
        return self.scheduler.metrics()


@pytest.mark.slow
def test_trainer_runs_through_the_scheduler_and_resumes(tmp_path):
    objective = GRPOObjective(tiny_decoder(), seq_len=WIDTH - 1, behavior_importance=2.0)
    weights = FakeWeights()
    source = FakeSource(weights, lambda s: Outcome(calls=1 + s.sample % 2, reward=float(s.sample)))
    records, logged = [], []
    scheduler = RolloutScheduler(
        objective, source, weights, width=WIDTH, rows=4, groups=2, log=records.append, audit=True
    )
    rollout = Checked(scheduler, objective)
    trainer = Trainer(
        objective, optax.adam(1e-2), key=jax.random.key(0), rollout=rollout,
        run_dir=tmp_path, progress=False, log=logged.append,
    )  # fmt: skip
    data = scheduler.tasks(task_data(8, 2))  # four batches an epoch
    try:
        state = trainer.fit(data, steps=3, log_every=3)
        assert int(state.step) == 3 and int(state.updates) == 3
        in_flight = [s for s in source.submitted if s.task in (6, 7)]  # batch 3, submitted ahead
        assert len(in_flight) == 4
        state = trainer.fit(data, steps=6, log_every=3)  # resumes from the step-3 checkpoint
        assert int(state.step) == 6
    finally:
        scheduler.close()
        source.close()

    for version, batch, expected in rollout.seen:
        mask = batch["response_mask"] == 1
        assert mask.any()
        np.testing.assert_allclose(
            batch["old_log_probs"][mask], expected[mask], rtol=1e-5, atol=1e-6
        )
        assert not np.allclose(batch["old_log_probs"][mask], batch["behavior_log_probs"][mask])
        assert batch["versions"][mask].min() >= version - 1
    assert [v for v, _, _ in rollout.seen] == [0, 1, 2, 3, 4, 5]
    assert weights.pushes == [1, 2, 3, 4, 5]
    assert [r.version for r in records] == [0, 1, 2, 3, 4, 5]
    assert all(r.lag is not None and r.lag <= 1 for r in records)
    assert all(r.admitted_groups == 2 and r.accounted == r.submitted for r in records)
    # the scheduler's figures reach the Trainer's log through rollout.metrics()
    lags = [line["rollout/lag"] for line in logged if "rollout/lag" in line]
    assert lags and all(0 <= lag <= 1 for lag in lags)
    assert all(line["rollout/admitted_groups"] == 2 for line in logged if "rollout/lag" in line)
    # The resumed fit replayed batches 0-2 without submitting them, cancelled what the old
    # stream had in flight (batch 3) and submitted batch 3 again in the new one.
    first_run = {s.group for s in in_flight}
    again = [s for s in source.submitted if s.task in (6, 7) and s.group not in first_run]
    assert len(again) >= 4
    old = [t for t in scheduler.ledger if t.key[0] in first_run]
    assert {t.cause for t in old} == {"reopened"} and len(old) == 4
    replayed = [s for s in source.submitted if s.task in (0, 1, 2, 3)]
    assert len(replayed) == 8 + 8  # once in epoch 0 and once in epoch 1: replays submit nothing
