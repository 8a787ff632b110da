"""Trainer and TrainState: updates against NumPy, EMA, accumulation, NaN guard, resume, logs.

The objective is a masked linear regression (tests/trainer_helpers.py) whose gradient is
written out in NumPy, so every number here has an independent reference and each Trainer
compiles in a fraction of a second.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from trainer_helpers import MaskedRegression, cycling, host, make_batch, numpy_loss_grad

from dew_pipe import Dataset, Trainer, TrainState
from dew_pipe.training import NonFiniteError

BATCHES = [make_batch(seed) for seed in range(5)]
KEY = jax.random.key(7)


def assert_trees_equal(a, b):
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(leaves_a) == len(leaves_b)
    for x, y in zip(leaves_a, leaves_b, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def sgd_reference(params, batches, lr):
    """Plain SGD on the NumPy gradient: the trajectory the Trainer must follow."""
    w = np.asarray(params["params"]["w"], np.float64)
    b = float(params["params"]["b"])
    for batch in batches:
        _, grad = numpy_loss_grad({"params": {"w": w, "b": b}}, batch)
        w, b = w - lr * grad["w"], b - lr * grad["b"]
    return w, b


# ------------------------------------------------------------------------- basics


def test_spec_usage_and_state_fields():
    trainer = Trainer(MaskedRegression(), optax.adamw(1e-3), key=jax.random.key(2))
    initial = trainer.initial_state()
    assert isinstance(initial, TrainState)
    assert (int(initial.step), int(initial.updates)) == (0, 0)
    assert initial.ema is None
    assert jax.dtypes.issubdtype(initial.rng.dtype, jax.dtypes.prng_key)
    assert initial.params["params"]["w"].sharding.is_fully_replicated
    state = trainer.fit(cycling(BATCHES), steps=20, log_every=10)
    assert (int(state.step), int(state.updates)) == (20, 20)
    assert not np.array_equal(state.params["params"]["w"], initial.params["params"]["w"])


def test_sgd_trajectory_matches_numpy():
    lr = 0.05
    trainer = Trainer(MaskedRegression(), optax.sgd(lr), key=KEY)
    start = host(trainer.initial_state().params)
    state = trainer.fit(cycling(BATCHES), steps=7, log_every=100)
    w, b = sgd_reference(start, list(itertools.islice(itertools.cycle(BATCHES), 7)), lr)
    np.testing.assert_allclose(state.params["params"]["w"], w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state.params["params"]["b"], b, rtol=1e-5, atol=1e-6)


def test_fit_starts_from_initial_state_and_continues_a_given_state():
    data = cycling(BATCHES)
    direct = Trainer(MaskedRegression(), optax.adam(1e-2), key=KEY).fit(data, steps=5)
    trainer = Trainer(MaskedRegression(), optax.adam(1e-2), key=KEY)
    first = trainer.fit(data, steps=2)
    assert int(first.step) == 2
    continued = trainer.fit(data, steps=5, state=first)  # data resumes at batch 3
    assert_trees_equal(
        (continued.params, continued.opt_state, jax.random.key_data(continued.rng)),
        (direct.params, direct.opt_state, jax.random.key_data(direct.rng)),
    )
    again = trainer.fit(data, steps=3, state=continued)  # already past 3: unchanged
    assert int(again.step) == 5


class _CountedBatches:
    """BATCHES cycled, counting every batch made (resumable by its index)."""

    def __init__(self, made: list[int]) -> None:
        self.made, self.next_batch = made, 0

    def __iter__(self):
        return self

    def __next__(self):
        self.made.append(self.next_batch)
        self.next_batch += 1
        return BATCHES[(self.next_batch - 1) % len(BATCHES)]

    def get_state(self):
        return {"next_batch": self.next_batch}

    def set_state(self, state):
        self.next_batch = state["next_batch"]


def test_fit_continuing_its_own_state_resumes_the_data_without_replaying_it():
    made: list[int] = []
    rows = len(next(iter(BATCHES[0].values())))
    data = Dataset(train=lambda partition: _CountedBatches(made), batch=rows)
    direct = Trainer(MaskedRegression(), optax.adam(1e-2), key=KEY).fit(data, steps=9)
    made.clear()
    trainer = Trainer(MaskedRegression(), optax.adam(1e-2), key=KEY)
    state = None
    for stop in (3, 6, 9):  # as train_sft's checks continue the state every few steps
        state = trainer.fit(data, steps=stop, log_every=100, state=state)
    assert_trees_equal(host(state.params), host(direct.params))
    # Each fit reads on from where the last one stopped; only the batch it read ahead
    # when it stopped is read again. A replay from the step count reads 0.. again.
    assert made == [0, 1, 2, 3, 3, 4, 5, 6, 6, 7, 8, 9], made
    # Another dataset at the same step has no position to resume: it replays, still exact.
    replayed: list[int] = []
    other = Dataset(train=lambda partition: _CountedBatches(replayed), batch=rows)
    fresh = Trainer(MaskedRegression(), optax.adam(1e-2), key=KEY)
    first = fresh.fit(data, steps=3)
    resumed = fresh.fit(other, steps=9, state=first)
    assert replayed[:3] == [0, 1, 2]  # the three consumed batches, read and dropped
    assert_trees_equal(host(resumed.params), host(direct.params))


def test_until_stops_after_the_step_it_accepts_logs_saves_and_a_later_fit_continues(tmp_path):
    made: list[int] = []
    rows = len(next(iter(BATCHES[0].values())))
    data = Dataset(train=lambda partition: _CountedBatches(made), batch=rows)
    direct = Trainer(MaskedRegression(), optax.adam(1e-2), key=KEY).fit(data, steps=9)
    records, seen = [], []

    def until(state):  # the state after each step; the step's record is not written yet
        seen.append((int(state.step), len(records)))
        return int(state.step) == 4

    def trainer(run_dir=None):
        return Trainer(
            MaskedRegression(), optax.adam(1e-2), key=KEY, run_dir=run_dir, log=records.append
        )

    state = trainer(tmp_path).fit(data, steps=9, log_every=3, until=until)
    assert int(state.step) == 4 and seen == [(1, 0), (2, 0), (3, 0), (4, 1)]
    assert [r["step"] for r in records] == [3, 4]  # the stopping step is logged, off cadence
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["4"]  # and saved, as at `steps`
    resumed = trainer(tmp_path).fit(data, steps=9)  # a new Trainer restores step 4
    assert_trees_equal(host(resumed.params), host(direct.params))
    with pytest.raises(TypeError, match="until is 3; expected None or a function of the state"):
        trainer().fit(data, steps=1, until=3)


# ------------------------------------------------------------------------- EMA


def test_ema_follows_numpy_average_of_the_params():
    decay, lr = 0.5, 0.1
    trainer = Trainer(MaskedRegression(ema_decay=decay), optax.sgd(lr), key=KEY)
    start = host(trainer.initial_state().params)
    state = trainer.fit(cycling(BATCHES), steps=3)
    ema_w = np.asarray(start["params"]["w"], np.float64)
    for n in range(1, 4):
        w, _ = sgd_reference(start, BATCHES[:n], lr)
        ema_w = decay * ema_w + (1 - decay) * w
    np.testing.assert_allclose(state.ema["params"]["w"], ema_w, rtol=1e-5, atol=1e-6)


def test_ema_decay_one_is_frozen_and_none_keeps_no_tree():
    trainer = Trainer(MaskedRegression(ema_decay=1.0), optax.sgd(0.5), key=KEY)
    start = host(trainer.initial_state().params)
    state = trainer.fit(cycling(BATCHES), steps=4)
    assert_trees_equal(state.ema, start)  # bit for bit: never recomputed
    assert not np.array_equal(state.params["params"]["w"], start["params"]["w"])
    plain = Trainer(MaskedRegression(ema_decay=None), optax.sgd(0.5), key=KEY)
    assert plain.fit(cycling(BATCHES), steps=1).ema is None


def test_reference_hook_sets_the_starting_ema():
    class Shifted(MaskedRegression):
        def reference(self, params):
            return jax.tree.map(lambda p: p + 1.0, params)

    state = Trainer(Shifted(ema_decay=1.0), optax.sgd(0.1), key=KEY).initial_state()
    np.testing.assert_allclose(state.ema["params"]["w"], state.params["params"]["w"] + 1.0)


# ------------------------------------------------------------------------- accumulation


def test_accumulation_equals_one_step_on_the_concatenated_batch():
    # Token counts 3 and 29: equal weighting of the two microbatches would be far off.
    small, large = make_batch(11, counted=3), make_batch(12, counted=29)
    joined = {k: np.concatenate([small[k], large[k]]) for k in small}
    lr = 0.1
    accumulated = Trainer(MaskedRegression(), optax.sgd(lr), key=KEY, accumulate=2)
    start = host(accumulated.initial_state().params)
    half = accumulated.fit(cycling([small, large]), steps=1)
    assert (int(half.step), int(half.updates)) == (1, 0)
    assert_trees_equal(half.params, start)  # nothing committed mid-window
    full = accumulated.fit(cycling([small, large]), steps=2, state=half)
    assert (int(full.step), int(full.updates)) == (2, 1)
    single = Trainer(MaskedRegression(), optax.sgd(lr), key=KEY).fit(cycling([joined]), steps=1)
    # float32 sums in a different order: a few ulps apart.
    np.testing.assert_allclose(full.params["params"]["w"], single.params["params"]["w"], rtol=1e-6)
    np.testing.assert_allclose(full.params["params"]["b"], single.params["params"]["b"], rtol=1e-6)
    w, _ = sgd_reference(start, [joined], lr)
    np.testing.assert_allclose(full.params["params"]["w"], w, rtol=1e-5)
    # The weighting matters: a plain mean of the two microbatch gradients lands elsewhere.
    grads = [numpy_loss_grad(start, b)[1]["w"] for b in (small, large)]
    naive = np.asarray(start["params"]["w"]) - lr * (grads[0] + grads[1]) / 2
    assert np.max(np.abs(naive - w)) > 1e-2


def test_accumulation_with_adam_counts_updates_and_keeps_inner_state():
    trainer = Trainer(MaskedRegression(), optax.adam(1e-2), key=KEY, accumulate=3)
    state = trainer.fit(cycling(BATCHES), steps=7)
    assert (int(state.step), int(state.updates)) == (7, 2)
    assert int(state.opt_state.count) == 1  # one microbatch into the third window
    assert int(state.opt_state.inner[0].count) == 2  # adam's own step counter


# ------------------------------------------------------------------------- NaN guard


def poisoned(batch, loss=False):
    out = dict(batch)
    if loss:
        out["y"] = batch["y"].copy()
        out["y"][0, 0] = np.nan
        out["mask"] = np.ones_like(batch["mask"])
    else:
        out["poison"] = np.zeros_like(batch["poison"])
    return out


@pytest.mark.parametrize(("loss", "named"), [(True, "loss"), (False, "grad_norm")])
def test_nan_guard_raises_naming_step_and_metric(loss, named):
    good = Trainer(MaskedRegression(), optax.sgd(0.1), key=KEY).fit(cycling(BATCHES[:2]), steps=2)
    data = cycling([BATCHES[0], BATCHES[1], poisoned(BATCHES[2], loss)])
    trainer = Trainer(MaskedRegression(), optax.sgd(0.1), key=KEY)
    with pytest.raises(NonFiniteError, match=rf"non-finite .*{named}.* at step 3") as caught:
        trainer.fit(data, steps=5)
    error = caught.value
    assert error.step == 3
    assert not np.isfinite(error.metrics[named])
    assert int(error.state.step) == 2  # the failed update was not applied
    assert_trees_equal(error.state.params, good.params)


def test_nan_guard_skip_consumes_the_batch_without_learning():
    records = []
    data = cycling([BATCHES[0], poisoned(BATCHES[1]), BATCHES[2]])
    skipper = Trainer(
        MaskedRegression(), optax.adam(1e-2), key=KEY, nan_guard="skip", log=records.append
    )
    state = skipper.fit(data, steps=3, log_every=3)
    assert (int(state.step), int(state.updates)) == (3, 2)
    assert records[-1]["skipped_nonfinite"] == 1
    clean = Trainer(MaskedRegression(), optax.adam(1e-2), key=KEY)
    expected = clean.fit(cycling([BATCHES[0], BATCHES[2]]), steps=2)
    assert_trees_equal((state.params, state.opt_state), (expected.params, expected.opt_state))


def test_nan_guard_skip_inside_an_accumulation_window():
    small, large = make_batch(11, counted=3), make_batch(12, counted=29)
    joined = {k: np.concatenate([small[k], large[k]]) for k in small}
    data = cycling([small, poisoned(large), large])
    trainer = Trainer(MaskedRegression(), optax.sgd(0.1), key=KEY, accumulate=2, nan_guard="skip")
    state = trainer.fit(data, steps=3)
    # the poisoned microbatch does not count toward the window of two
    assert (int(state.step), int(state.updates)) == (3, 1)
    single = Trainer(MaskedRegression(), optax.sgd(0.1), key=KEY).fit(cycling([joined]), steps=1)
    np.testing.assert_allclose(state.params["params"]["w"], single.params["params"]["w"], rtol=1e-6)


def test_nan_guard_off_applies_the_nan():
    trainer = Trainer(MaskedRegression(), optax.sgd(0.1), key=KEY, nan_guard=False)
    state = trainer.fit(cycling([poisoned(BATCHES[0])]), steps=1)
    assert np.isnan(np.asarray(state.params["params"]["w"])).all()


# ------------------------------------------------------------------------- rollout


def test_rollout_runs_before_the_update_with_state_and_key():
    calls = []

    def rollout(state, batch, key):
        calls.append((int(state.step), int(state.updates), np.asarray(jax.random.key_data(key))))
        return dict(batch, y=batch["y"] * 2.0)

    doubled = [dict(b, y=b["y"] * 2.0) for b in BATCHES]
    trainer = Trainer(MaskedRegression(), optax.sgd(0.1), key=KEY, rollout=rollout)
    state = trainer.fit(cycling(BATCHES), steps=3)
    reference = Trainer(MaskedRegression(), optax.sgd(0.1), key=KEY).fit(cycling(doubled), steps=3)
    assert_trees_equal(state.params, reference.params)
    assert [c[:2] for c in calls] == [(0, 0), (1, 1), (2, 2)]
    assert len({c[2].tobytes() for c in calls}) == 3  # a fresh key each step
    again = []
    Trainer(
        MaskedRegression(),
        optax.sgd(0.1),
        key=KEY,
        rollout=lambda s, b, k: again.append(np.asarray(jax.random.key_data(k))) or b,
    ).fit(cycling(BATCHES), steps=3)
    assert [a.tobytes() for a in again] == [c[2].tobytes() for c in calls]  # deterministic


def test_rollout_may_change_the_batch_size():
    def grow(state, batch, key):
        return {k: np.concatenate([v, v]) for k, v in batch.items()}

    state = Trainer(MaskedRegression(), optax.sgd(0.1), key=KEY, rollout=grow).fit(
        cycling(BATCHES), steps=2
    )
    assert int(state.step) == 2


class Shrinking:
    """A rollout keeping the first ``rows[step]`` examples of each batch (rows_vary)."""

    rows_vary = True

    def __init__(self, rows, also=None):
        self.rows, self.also, self.calls = rows, also, 0

    def __call__(self, state, batch, key):
        keep = self.rows[self.calls]
        self.calls += 1
        out = {k: v[:keep] for k, v in batch.items()}
        if self.also is not None and self.calls > 1:
            out = self.also(out)
        return out


def test_a_rollout_whose_rows_vary_may_change_only_the_row_count():
    rows = [8, 3, 5]
    trainer = Trainer(MaskedRegression(), optax.sgd(0.1), key=KEY, rollout=Shrinking(rows))
    start = host(trainer.initial_state().params)
    state = trainer.fit(cycling(BATCHES), steps=3)
    cut = [{k: v[:n] for k, v in b.items()} for b, n in zip(BATCHES, rows, strict=False)]
    w, b = sgd_reference(start, cut, 0.1)  # each update on the rows it was given
    np.testing.assert_allclose(state.params["params"]["w"], w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state.params["params"]["b"], b, rtol=1e-5, atol=1e-6)
    fixed = Shrinking(rows)
    fixed.rows_vary = False
    with pytest.raises(
        ValueError, match=r"training batch 2 field .* expected one layout for every batch \("
    ):
        Trainer(MaskedRegression(), optax.sgd(0.1), key=KEY, rollout=fixed).fit(
            cycling(BATCHES), steps=2
        )
    wider = Shrinking(rows, also=lambda b: dict(b, x=np.concatenate([b["x"], b["x"]], axis=1)))
    with pytest.raises(ValueError, match="field 'x' .* every batch but for its rows"):
        Trainer(MaskedRegression(), optax.sgd(0.1), key=KEY, rollout=wider).fit(
            cycling(BATCHES), steps=2
        )
    ragged = Shrinking(rows, also=lambda b: dict(b, y=b["y"][:0]))
    with pytest.raises(ValueError, match="training batch 2 field 'y' has 0 rows but 'x' has 3"):
        Trainer(MaskedRegression(), optax.sgd(0.1), key=KEY, rollout=ragged).fit(
            cycling(BATCHES), steps=2
        )


# ------------------------------------------------------------------------- checkpoints


def test_interrupted_and_resumed_run_equals_uninterrupted_bit_for_bit(tmp_path):
    def trainer(run_dir=None):
        return Trainer(
            MaskedRegression(ema_decay=0.9),
            optax.adamw(1e-2),
            key=KEY,
            run_dir=run_dir,
            checkpoint_every=None if run_dir is None else 3,
        )

    data = cycling(BATCHES, records=16)
    first = trainer(tmp_path).fit(data, steps=3)
    assert int(first.step) == 3
    resumed = trainer(tmp_path).fit(data, steps=6)  # a new Trainer: restores step 3
    straight = trainer().fit(data, steps=6)
    for field in ("step", "updates", "params", "opt_state", "ema"):
        assert_trees_equal(getattr(resumed, field), getattr(straight, field))
    assert_trees_equal(jax.random.key_data(resumed.rng), jax.random.key_data(straight.rng))
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [3, 6]


def test_resume_from_a_checkpoint_taken_mid_run(tmp_path):
    # Saves at 2 and 4 happen while training goes on (asynchronous writes, donated
    # buffers); dropping step 5 makes the resume start from the mid-run save.
    def trainer(run_dir=None):
        return Trainer(
            MaskedRegression(ema_decay=0.5),
            optax.adam(1e-2),
            key=KEY,
            run_dir=run_dir,
            checkpoint_every=None if run_dir is None else 2,
            keep_checkpoints=2,
            accumulate=2,
        )

    data = cycling(BATCHES)
    trainer(tmp_path).fit(data, steps=5)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["4", "5"]  # bounded to 2
    shutil.rmtree(tmp_path / "checkpoints" / "5")
    resumed = trainer(tmp_path).fit(data, steps=7)
    straight = trainer().fit(data, steps=7)
    assert_trees_equal(
        (resumed.params, resumed.opt_state, resumed.ema, jax.random.key_data(resumed.rng)),
        (straight.params, straight.opt_state, straight.ema, jax.random.key_data(straight.rng)),
    )


class CountingBatches:
    """An iterator with get_state/set_state, counting every batch it produces."""

    produced = 0

    def __init__(self):
        self.index = 0

    def __next__(self):
        CountingBatches.produced += 1
        batch = BATCHES[self.index % len(BATCHES)]
        self.index += 1
        return batch

    def __iter__(self):
        return self

    def get_state(self):
        return {"index": self.index}

    def set_state(self, state):
        self.index = state["index"]


def test_resume_uses_the_iterator_state_instead_of_replaying(tmp_path):
    data = Dataset(train=lambda partition: CountingBatches(), val=None, records=None, batch=8)

    def trainer(run_dir=None):
        return Trainer(
            MaskedRegression(), optax.sgd(0.1), key=KEY, run_dir=run_dir, checkpoint_every=2
        )

    trainer(tmp_path).fit(data, steps=4)
    CountingBatches.produced = 0
    resumed = trainer(tmp_path).fit(data, steps=6)
    assert CountingBatches.produced <= 2 + 1  # the new batches (+1 read ahead), no replay
    straight = Trainer(MaskedRegression(), optax.sgd(0.1), key=KEY).fit(data, steps=6)
    assert_trees_equal(resumed.params, straight.params)


def test_iterator_state_must_be_json_for_checkpoints(tmp_path):
    class SetState(CountingBatches):
        def get_state(self):
            return {self.index}

    data = Dataset(train=lambda partition: SetState(), val=None, records=None, batch=8)
    state = Trainer(MaskedRegression(), optax.sgd(0.1), key=KEY).fit(data, steps=2)
    assert int(state.step) == 2  # no checkpoint, no need to serialize
    trainer = Trainer(MaskedRegression(), optax.sgd(0.1), key=KEY, run_dir=tmp_path)
    with pytest.raises(TypeError, match=r"get_state\(\) returned set; expected a JSON"):
        trainer.fit(data, steps=2)


@pytest.mark.parametrize(("rollout_ahead", "expected"), [(None, [2, 3, 4]), (2, [3, 4, 5])])
def test_batches_are_read_ahead_of_the_rollout(rollout_ahead, expected):
    seen = []

    class Rollout:
        def __call__(self, state, batch, key):
            seen.append(CountingBatches.produced)
            return batch

    rollout = Rollout()
    if rollout_ahead is not None:
        rollout.read_ahead = rollout_ahead
    CountingBatches.produced = 0
    data = Dataset(train=lambda partition: CountingBatches(), val=None, records=None, batch=8)
    Trainer(MaskedRegression(), optax.sgd(0.1), key=KEY, rollout=rollout).fit(data, steps=3)
    assert seen == expected  # batch i is handed over once batches up to i + read_ahead are read


def test_epochs_restart_the_data_and_resume_across_an_epoch_boundary(tmp_path):
    finite = Dataset(train=lambda partition: iter(BATCHES[:3]), val=None, records=24, batch=8)
    records = []
    straight = Trainer(MaskedRegression(), optax.sgd(0.1), key=KEY, log=records.append).fit(
        finite, steps=7, log_every=7
    )
    assert records[-1]["epoch"] == pytest.approx(7 / 3)
    expected = Trainer(MaskedRegression(), optax.sgd(0.1), key=KEY).fit(
        cycling(BATCHES[:3]), steps=7
    )
    assert_trees_equal(straight.params, expected.params)
    kwargs = {"key": KEY, "run_dir": tmp_path, "checkpoint_every": 4}
    Trainer(MaskedRegression(), optax.sgd(0.1), **kwargs).fit(finite, steps=4)
    resumed = Trainer(MaskedRegression(), optax.sgd(0.1), **kwargs).fit(finite, steps=7)
    assert_trees_equal(resumed.params, straight.params)


def test_checkpoint_of_another_setup_is_refused(tmp_path):
    Trainer(MaskedRegression(), optax.adam(1e-2), key=KEY, run_dir=tmp_path).fit(
        cycling(BATCHES), steps=1
    )
    other = Trainer(MaskedRegression(ema_decay=0.9), optax.adam(1e-2), key=KEY, run_dir=tmp_path)
    with pytest.raises(ValueError, match="does not match this trainer's state"):
        other.fit(cycling(BATCHES), steps=2)
    rbg = jax.random.key(7, impl="rbg")
    other = Trainer(MaskedRegression(), optax.adam(1e-2), key=rbg, run_dir=tmp_path)
    with pytest.raises(ValueError, match="holds a 'threefry2x32' key; expected 'rbg'"):
        other.fit(cycling(BATCHES), steps=2)


# ------------------------------------------------------------------------- logging, eval


def test_metrics_jsonl_callback_and_validation(tmp_path):
    records = []
    optimizer = optax.inject_hyperparams(optax.sgd)(learning_rate=0.05)
    trainer = Trainer(MaskedRegression(), optimizer, key=KEY, run_dir=tmp_path, log=records.append)
    data = cycling(BATCHES[:2])
    start = host(trainer.initial_state().params)
    state = trainer.fit(data, steps=4, log_every=2, eval_every=4, eval_batches=1)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == records
    train = [r for r in lines if "loss" in r]
    assert [r["step"] for r in train] == [2, 4]
    first = train[0]
    for name in ("updates", "grad_norm", "tokens_per_s", "seconds", "elapsed", "mean_y"):
        assert name in first
    assert first["learning_rate"] == pytest.approx(0.05)
    # loss and tokens of the first interval against NumPy
    losses = [numpy_loss_grad(start, BATCHES[0])[0]]
    w, b = sgd_reference(start, BATCHES[:1], 0.05)
    losses.append(numpy_loss_grad({"params": {"w": w, "b": b}}, BATCHES[1])[0])
    assert first["loss"] == pytest.approx(np.mean(losses), rel=1e-5)
    assert first["tokens"] == BATCHES[0]["mask"].sum() + BATCHES[1]["mask"].sum()
    assert first["tokens_per_s"] == pytest.approx(first["tokens"] / first["seconds"])
    (val,) = [r for r in lines if "val/mse" in r]
    assert val["step"] == 4
    mse, _ = numpy_loss_grad(host(state.params), BATCHES[0])
    assert val["val/mse"] == pytest.approx(mse, rel=1e-5)


def test_progress_bar_renders_when_asked(capfd):
    Trainer(MaskedRegression(), optax.sgd(0.1), key=KEY, progress=True).fit(
        cycling(BATCHES), steps=2, log_every=1
    )
    err = capfd.readouterr().err
    assert "train" in err and "2/2" in err
    Trainer(MaskedRegression(), optax.sgd(0.1), key=KEY).fit(cycling(BATCHES), steps=1)
    assert capfd.readouterr().err == ""  # not a terminal: quiet


# ------------------------------------------------------------------------- bad input


def test_batch_errors_name_the_field_and_sizes():
    short = Dataset(train=lambda p: itertools.repeat(make_batch(0, rows=4)), val=None, batch=8)
    with pytest.raises(ValueError, match=r"training batch 1 has 4 rows \(field 'x'\); expected 8"):
        Trainer(MaskedRegression(), optax.sgd(0.1), key=KEY).fit(short, steps=1)
    changing = Dataset(
        train=lambda p: iter([BATCHES[0], dict(BATCHES[1], y=BATCHES[1]["y"][:, :2])]), batch=8
    )
    with pytest.raises(ValueError, match=r"field 'y' has 2 rows|training batch 2 field 'y'"):
        Trainer(MaskedRegression(), optax.sgd(0.1), key=KEY).fit(changing, steps=2)
    empty = Dataset(train=lambda p: iter(()), batch=8)
    with pytest.raises(ValueError, match="yielded no batches in epoch 0"):
        Trainer(MaskedRegression(), optax.sgd(0.1), key=KEY).fit(empty, steps=1)


def test_an_update_on_zero_rows_is_refused_before_anything_moves():
    # adamw's weight decay would move the parameters on an empty batch's zero gradient.
    trainer = Trainer(MaskedRegression(), optax.adamw(0.1, weight_decay=0.5), key=KEY)
    state = trainer.initial_state()
    before = jax.device_get(state.params)
    empty = {name: value[:0] for name, value in BATCHES[0].items()}
    with pytest.raises(ValueError, match=r"batch has 0 rows \(field 'x' has shape \(0, 4, 3\)\)"):
        trainer.train_step(state, empty)
    # Nothing was dispatched, so the state was not donated: still readable, unchanged.
    assert int(state.step) == 0 and int(state.updates) == 0
    assert_trees_equal(state.params, before)
    state, _ = trainer.train_step(state, BATCHES[0])  # the state is still usable
    assert int(state.updates) == 1

    class EmptyingRollout:  # a rollout whose batch comes back with no rows (all filtered)
        def __call__(self, state, batch, key):
            return {name: value[:0] for name, value in batch.items()}

    emptying = Trainer(MaskedRegression(), optax.adamw(0.1), key=KEY, rollout=EmptyingRollout())
    with pytest.raises(ValueError, match=r"training batch 1 has 0 rows \(field 'x'"):
        emptying.fit(cycling(BATCHES), steps=1)


def test_fit_argument_errors():
    trainer = Trainer(MaskedRegression(), optax.sgd(0.1), key=KEY)
    no_val = Dataset(train=lambda p: itertools.repeat(BATCHES[0]), val=None, batch=8)
    with pytest.raises(ValueError, match=r"steps is -1; expected an int >= 0"):
        trainer.fit(no_val, steps=-1)
    with pytest.raises(ValueError, match=r"log_every is 0"):
        trainer.fit(no_val, steps=1, log_every=0)
    with pytest.raises(ValueError, match=r"eval_every=2 but Dataset.val is None"):
        trainer.fit(no_val, steps=1, eval_every=2)
    with pytest.raises(TypeError, match="data is a list; expected a dew_pipe.Dataset"):
        trainer.fit([BATCHES[0]], steps=1)


class NoEvaluate:
    ema_decay = None

    def init(self, key):
        return {"params": {}}

    def loss(self, params, batch, key, ema):
        return 0.0, {}


class BadDecay(MaskedRegression):
    ema_decay = 1.5

    def __init__(self):
        pass


@pytest.mark.parametrize(
    ("objective", "kwargs", "error", "message"),
    [
        (NoEvaluate(), {}, TypeError, "has no method 'evaluate'"),
        (BadDecay(), {}, ValueError, r"ema_decay=1.5; expected None or a float in \[0, 1\]"),
        (None, {"checkpoint_every": 5}, ValueError, "checkpoint_every=5 needs a run_dir"),
        (None, {"accumulate": 0}, ValueError, "accumulate is 0; expected an int >= 1"),
        (None, {"nan_guard": "maybe"}, ValueError, "nan_guard='maybe'; expected True, False"),
        (None, {"key": 3}, TypeError, r"key=3; expected a typed PRNG key"),
        (None, {"rollout": 5}, TypeError, "rollout=5; expected None or rollout"),
        (None, {"devices": []}, ValueError, r"devices=\[\]"),
    ],
)
def test_trainer_argument_errors(objective, kwargs, error, message):
    kwargs = {"key": KEY, **kwargs}
    with pytest.raises(error, match=message):
        Trainer(objective or MaskedRegression(), optax.sgd(0.1), **kwargs)


def test_legacy_raw_keys_are_accepted():
    raw = jax.random.PRNGKey(7)
    state = Trainer(MaskedRegression(), optax.sgd(0.1), key=raw).initial_state()
    typed = Trainer(MaskedRegression(), optax.sgd(0.1), key=KEY).initial_state()
    assert_trees_equal(state.params, typed.params)


# ------------------------------------------------------------------------- devices

MULTI_DEVICE = Path(__file__).with_name("multi_device_trainer.py")


@pytest.mark.slow
def test_eight_simulated_devices_give_the_update_of_one():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(MULTI_DEVICE.parent), env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, str(MULTI_DEVICE)], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ok" in result.stdout


@pytest.mark.parametrize(
    "module",
    [
        "dew_pipe.training",
        "dew_pipe.training.objective",
        "dew_pipe.training.step",
        "dew_pipe.training.checkpoints",
        "dew_pipe.training.log",
        "dew_pipe.training.data_stream",
        "dew_pipe._jsonl",
    ],
)
def test_training_docstring_examples_run(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module))
    assert result.failed == 0
