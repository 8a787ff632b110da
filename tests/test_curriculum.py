"""PassRateCurriculum: which prompts it serves, how long solved ones rest, its feedback from
a real SampledRollout under Trainer.fit, and its refusals."""

from __future__ import annotations

import doctest

import jax
import numpy as np
import optax
import pytest

from dew_pipe import Trainer, models
from dew_pipe.data import Partition, PassRateCurriculum, encode_text_column
from dew_pipe.inference import SampledRollout
from dew_pipe.objectives.rl import GRPOObjective
from dew_pipe.sampling import Sampling


def _pool(n: int) -> dict[str, np.ndarray]:
    return {
        "prompt": np.arange(2 * n, dtype=np.int32).reshape(n, 2),
        "prompt_length": np.full(n, 2, np.int32),
    }


def _served(batches, count: int) -> list[list[int]]:
    return [next(batches)["pool_index"].tolist() for _ in range(count)]


def test_batches_follow_the_pool_and_carry_its_rows():
    pool = _pool(5)
    curriculum = PassRateCurriculum(pool, batch=2)
    batches = curriculum.dataset().open_train(Partition(0, 1))
    first = next(batches)
    assert first["pool_index"].tolist() == [0, 1]
    np.testing.assert_array_equal(first["prompt"], pool["prompt"][:2])
    np.testing.assert_array_equal(first["prompt_length"], pool["prompt_length"][:2])
    # nothing observed: round robin over the pool, across its end
    assert _served(batches, 3) == [[2, 3], [4, 0], [1, 2]]
    assert curriculum.served == 8 and curriculum.skipped == 0


def test_a_solved_prompt_rests_for_rest_passes_then_comes_back():
    curriculum = PassRateCurriculum(_pool(4), batch=2, rest=2)
    batches = curriculum.dataset().open_train(Partition(0, 1))
    first = next(batches)  # [0, 1] in pass 0
    # prompt 0 solved by every completion; prompt 1 only by some: not solved
    curriculum.observe(first["pool_index"], np.array([[1.0, 1.0, 1.0], [1.0, 0.0, 1.0]]))
    assert curriculum.solved_prompts() == 1
    # pass 0 goes on; passes 1 and 2 skip prompt 0; pass 3 serves it again
    assert _served(batches, 6) == [[2, 3], [1, 2], [3, 1], [2, 3], [0, 1], [2, 3]]
    assert curriculum.skipped == 2
    assert curriculum.served == 2 + 12


def test_a_rested_prompt_that_fails_again_is_served_every_pass():
    curriculum = PassRateCurriculum(_pool(2), batch=1, rest=1)
    batches = curriculum.dataset().open_train(Partition(0, 1))
    assert _served(batches, 1) == [[0]]
    curriculum.observe(np.array([0]), [[2.0, 1.5]])  # above solved=1.0 counts as solved
    assert _served(batches, 3) == [[1], [1], [0]]  # pass 1 skips 0
    curriculum.observe(np.array([0]), [[0.0, 1.0]])
    assert _served(batches, 4) == [[1], [0], [1], [0]]
    assert curriculum.solved_prompts() == 0


def test_the_solved_threshold_is_a_reward():
    curriculum = PassRateCurriculum(_pool(3), batch=1, solved=0.5)
    batches = curriculum.dataset().open_train(Partition(0, 1))
    next(batches)
    curriculum.observe(np.array([0]), [[0.5, 0.7]])
    assert curriculum.solved_prompts() == 1
    curriculum.observe(np.array([0]), [[0.5, 0.49]])
    assert curriculum.solved_prompts() == 0
    assert _served(batches, 3) == [[1], [2], [0]]


def test_processes_read_their_own_prompts():
    curriculum = PassRateCurriculum(_pool(6), batch=4)
    first = curriculum.dataset().open_train(Partition(0, 2))
    second = curriculum.dataset().open_train(Partition(1, 2))
    assert _served(first, 2) == [[0, 2], [4, 0]]
    assert _served(second, 2) == [[1, 3], [5, 1]]


def test_bad_settings_and_feedback_are_refused_by_name():
    with pytest.raises(TypeError, match="pool is list"):
        PassRateCurriculum([1, 2], batch=1)
    with pytest.raises(ValueError, match="'pool_index'"):
        PassRateCurriculum({**_pool(2), "pool_index": np.arange(2)}, batch=1)
    with pytest.raises(ValueError, match="one row count"):
        PassRateCurriculum({"prompt": np.zeros((3, 2)), "prompt_length": np.zeros(2)}, batch=1)
    with pytest.raises(ValueError, match="0 rows"):
        PassRateCurriculum({"prompt": np.zeros((0, 2))}, batch=1)
    with pytest.raises(ValueError, match="batch"):
        PassRateCurriculum(_pool(2), batch=3)
    with pytest.raises(ValueError, match="rest"):
        PassRateCurriculum(_pool(2), batch=1, rest=0)
    with pytest.raises(ValueError, match="solved is nan"):
        PassRateCurriculum(_pool(2), batch=1, solved=float("nan"))
    curriculum = PassRateCurriculum(_pool(2), batch=1)
    with pytest.raises(ValueError, match=r"indices\[0\] is 2; expected a pool index in \[0, 2\)"):
        curriculum.observe(np.array([2]), [[1.0]])
    with pytest.raises(ValueError, match="2 groups for 1 indices"):
        curriculum.observe(np.array([0]), [[1.0], [1.0]])
    with pytest.raises(ValueError, match=r"rewards\[0\] is \[nan\]"):
        curriculum.observe(np.array([0]), [[float("nan")]])
    with pytest.raises(ValueError, match=r"rewards\[0\] is \[\]"):
        curriculum.observe(np.array([0]), [[]])
    with pytest.raises(ValueError, match="integer pool indices"):
        curriculum.observe(np.array([0.5]), [[1.0]])
    assert curriculum.solved_prompts() == 0  # nothing recorded by a refused call
    with pytest.raises(ValueError, match="no 'pool_index' column"):
        curriculum.watch(lambda state, batch, key: batch)(None, _pool(1), None)
    with pytest.raises(TypeError, match="keeps no last_sessions"):
        curriculum.watch(lambda state, batch, key: batch)(None, {"pool_index": [0]}, None)
    with pytest.raises(TypeError, match="expected rollout"):
        curriculum.watch(3)


def test_watched_sampled_rollout_rests_what_it_solves_and_logs_under_fit():
    """A real SampledRollout: prompts whose truth is "even" earn 1.0 on every completion, the
    others 0 (never solved); after the first pass the even ones rest."""
    model = models.build(
        "causal_transformer",
        vocab_size=8,
        emb_features=16,
        num_layers=1,
        num_heads=2,
        mlp_features=32,
        max_seq_len=8,
    )
    objective = GRPOObjective(model, seq_len=5)

    def reward(data_source, completion, ground_truth, extra_info):
        return 1.0 if ground_truth == "even" else 0.0

    n = 6
    pool = {
        "prompt": np.stack([np.array([i, 3, 4], np.int32) for i in range(n)]),
        "prompt_length": np.full(n, 3, np.int32),
        "ground_truth": encode_text_column(["odd", "even"][i % 2 == 0] for i in range(n)),
    }
    curriculum = PassRateCurriculum(pool, batch=2, rest=1)
    sampled = SampledRollout(
        objective, reward, groups=4, max_new_tokens=3, sampling=Sampling(eos_id=2)
    )
    watched = curriculum.watch(sampled)
    trainer = Trainer(objective, optax.adam(1e-3), key=jax.random.key(0))
    state = trainer.initial_state()
    batches = curriculum.dataset().open_train(Partition(0, 1))
    seen = []
    for step in range(6):
        batch = next(batches)
        seen.append(batch["pool_index"].tolist())
        state, _ = trainer.train_step(state, watched(state, batch, jax.random.key(step)))
        for session in sampled.last_sessions:  # the watched rollout's own groups
            solved = batch["pool_index"][session.group] % 2 == 0
            assert session.reward == (1.0 if solved else 0.0)
    # pass 0 serves all six; pass 1 only the odd three (the even ones rest); pass 2 all again
    assert seen == [[0, 1], [2, 3], [4, 5], [1, 3], [5, 0], [1, 2]]
    assert curriculum.skipped == 3 and curriculum.solved_prompts() >= 1
    metrics = watched.metrics()
    assert metrics["curriculum/skipped"] == 3.0 and metrics["curriculum/served"] == 12.0
    assert metrics["reward/mean"] == sampled.metrics()["reward/mean"]  # the rollout's own

    logged = []
    again = PassRateCurriculum(pool, batch=2)
    fitted = Trainer(
        objective,
        optax.adam(1e-3),
        key=jax.random.key(0),
        rollout=again.watch(sampled),
        log=logged.append,
        progress=False,
    )
    fitted.fit(again.dataset(), steps=2, log_every=1)
    assert "rollout/curriculum/served" in logged[-1] and "rollout/reward/mean" in logged[-1]


def test_docstring_examples_run():
    from dew_pipe.data import curriculum

    result = doctest.testmod(curriculum, extraglobs={"np": np, "Partition": Partition})
    assert result.attempted > 0 and result.failed == 0
