"""SampledRollout: prompts in, scored and packed GRPO rows out; and the spec's GRPO example.

Most tests use a decoder whose next token is known by construction: its blocks add nothing
(attention and MLP output weights are zero), so the logits after id ``x`` are the head's row
``x`` times the final norm's constant gain. Greedy continuations and every likelihood then
follow from a few NumPy lines, independently of the cached generation being tested.
"""

from __future__ import annotations

import itertools
import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew_pipe import Dataset, Sampling, Trainer, models
from dew_pipe.data.text_columns import encode_text_column
from dew_pipe.objectives.rl import GRPOObjective, SampledRollout
from dew_pipe.objectives.rl.sessions import Status

VOCAB, DIM, EOS = 8, 8, 7
NORM_EPS = 1e-6  # the decoder's default
GREEDY = Sampling(eos_id=EOS, temperature=0)  # shared, so the failure tests reuse one compile


def successor(token: int) -> int:
    """The known model's greedy next id: 1 -> 2 -> ... -> 7 (EOS) -> 1."""
    return token + 1 if token < VOCAB - 1 else 1


@pytest.fixture(scope="module")
def known():
    """A decoder whose logits after id x are ``head[x] / sqrt(1 / DIM + eps)``."""
    model = models.build(
        "causal_transformer",
        vocab_size=VOCAB,
        emb_features=DIM,
        num_layers=1,
        num_heads=2,
        mlp_features=16,
        max_seq_len=16,
    )
    variables = model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    rng = np.random.default_rng(0)
    head = rng.normal(0.0, 0.5, (VOCAB, VOCAB)).astype(np.float32)
    for token in range(VOCAB):
        head[token, successor(token)] += 3.0

    def set_leaf(path, leaf):
        name = jax.tree_util.keystr(path)
        if name.endswith("['o']") or name.endswith("['down']"):
            return jnp.zeros_like(leaf)  # blocks add nothing: the residual is the embedding
        if name.endswith("['embed']"):
            return jnp.eye(VOCAB, DIM, dtype=leaf.dtype)
        if name.endswith("['lm_head']"):
            return jnp.asarray(head)  # [D, V] with D == V: one-hot x picks head[x]
        return leaf

    variables = jax.tree_util.tree_map_with_path(set_leaf, variables)
    logits = head / np.sqrt(1.0 / DIM + NORM_EPS)  # logits[x] = what follows id x
    return types.SimpleNamespace(model=model, variables=variables, logits=logits)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


def prompt_batch(rows, width, **metadata):
    """A Prompts-style batch: left-padded ids (padding 0) and UTF-8 metadata columns."""
    prompt = np.zeros((len(rows), width), np.int32)
    for b, ids in enumerate(rows):
        prompt[b, width - len(ids) :] = ids
    batch = {"prompt": prompt, "prompt_length": np.array([len(r) for r in rows], np.int32)}
    for name, values in metadata.items():
        batch[name] = encode_text_column(values, field=name)
    return batch


def state_at(variables, updates):
    return types.SimpleNamespace(params=variables, updates=jnp.int32(updates))


class Recorder:
    """A reward that records its arguments and returns 0, 1, 2, ... in call order."""

    def __init__(self):
        self.calls = []

    def __call__(self, data_source, completion, ground_truth, extra_info):
        self.calls.append((data_source, completion, ground_truth, extra_info))
        return float(len(self.calls) - 1)


# ----------------------------------------------------------------- the packed batch


@pytest.fixture(scope="module")
def greedy_run(known):
    """Two prompts (2 and 3 ids, left padded to 3), two greedy samples each, budget 4."""
    reward = Recorder()
    objective = GRPOObjective(known.model, seq_len=6)
    rollout = SampledRollout(objective, reward, groups=2, max_new_tokens=4, sampling=GREEDY)
    batch = prompt_batch(
        [[1, 2], [3, 4, 5]],
        3,
        data_source=["src-a", "src-b"],
        ground_truth=["6", "dog"],
        extra_info=['{"k": 1}', ""],
    )
    packed = rollout(state_at(known.variables, 5), batch, jax.random.key(0))
    return types.SimpleNamespace(packed=packed, reward=reward, rollout=rollout)


def expected_batch(known) -> dict[str, np.ndarray]:
    """The packed rows written out by hand for the greedy run.

    Prompt 0 ([1, 2]) continues 3, 4, 5, 6 and hits the budget; prompt 1 ([3, 4, 5])
    continues 6, 7 and stops on EOS 7. Chains of 6 and 5 ids cannot share a 7-wide row,
    so each of the four completions (session b * 2 + g) has a row of its own, in order.
    Rewards 0, 1 (prompt 0) and 2, 3 (prompt 1) standardize to -/+ 1/sqrt(2) per group.
    """
    chains = [[1, 2, 3, 4, 5, 6]] * 2 + [[3, 4, 5, 6, 7]] * 2
    prompt_lengths = [2, 2, 3, 3]
    advantage = 0.5 / (math.sqrt(0.5) + 1e-6)
    out = {
        name: np.zeros((4, 7), np.float32 if name.endswith("probs") else np.int32)
        for name in ("input_ids", "text_segment_ids", "text_positions", "response_mask")
    }
    out["old_log_probs"] = np.zeros((4, 7), np.float32)
    out["behavior_log_probs"] = np.zeros((4, 7), np.float32)  # greedy: the id is certain
    out["advantages"] = np.zeros((4, 7), np.float32)
    out["session_weights"] = np.zeros((4, 7), np.float32)
    for name in ("versions", "session_index", "call_index"):
        out[name] = np.full((4, 7), -1, np.int32)
    for row, (chain, n) in enumerate(zip(chains, prompt_lengths, strict=True)):
        end = len(chain)
        out["input_ids"][row, :end] = chain
        out["text_segment_ids"][row, :end] = 1
        out["text_positions"][row, :end] = np.arange(end)
        out["response_mask"][row, n:end] = 1  # EOS included
        out["advantages"][row, :end] = advantage if row % 2 else -advantage
        out["session_weights"][row, :end] = 1.0 / (end - n)
        out["versions"][row, n:end] = 5
        out["session_index"][row, n:end] = row
        out["call_index"][row, n:end] = 0
        for column in range(n, end):
            previous, token = chain[column - 1], chain[column]
            out["old_log_probs"][row, column] = log_softmax(known.logits[previous])[token]
    return out


def test_packed_columns_match_a_hand_built_batch(known, greedy_run):
    expected = expected_batch(known)
    assert sorted(greedy_run.packed) == sorted(expected)
    for name, want in expected.items():
        got = greedy_run.packed[name]
        assert got.dtype == want.dtype and got.shape == (4, 7), name
        if want.dtype == np.float32:
            np.testing.assert_allclose(got, want, rtol=0, atol=2e-6, err_msg=name)
        else:
            np.testing.assert_array_equal(got, want, err_msg=name)


def test_every_completion_is_scored_with_strings_and_without_eos(greedy_run):
    # Called once per completion, prompt by prompt, with the metadata decoded from UTF-8;
    # prompt 0's completions ran out of budget and are scored all the same.
    assert greedy_run.reward.calls == [
        ("src-a", "3 4 5 6", "6", '{"k": 1}'),
        ("src-a", "3 4 5 6", "6", '{"k": 1}'),
        ("src-b", "6", "dog", ""),  # EOS 7 is left out of the text ...
        ("src-b", "6", "dog", ""),
    ]
    assert greedy_run.packed["response_mask"][2, 4] == 1  # ... but trains (column of the 7)
    sessions = greedy_run.rollout.last_sessions
    assert [s.status for s in sessions] == [Status.TRUNCATED] * 2 + [Status.COMPLETED] * 2
    assert [s.calls[0].finish_reason for s in sessions] == ["length"] * 2 + ["stop"] * 2
    assert [(s.task, s.group, s.sample, s.reward) for s in sessions] == [
        (0, 0, 0, 0.0),
        (0, 0, 1, 1.0),
        (1, 1, 0, 2.0),
        (1, 1, 1, 3.0),
    ]
    assert greedy_run.rollout.metrics() == {
        "reward/mean": 1.5,
        "reward/positive": 0.75,
        "response/length": 3.0,
        "response/truncated": 0.5,
        "groups/zero_advantage": 0.0,
        "rows": 4.0,
    }


def test_truncation_modes_decide_how_budget_hits_train(known):
    batch = prompt_batch([[1, 2], [3, 4, 5]], 3)
    objective = GRPOObjective(known.model, seq_len=6)
    greedy = GREEDY
    for mode, trained in (("score", 4), ("zero", 4), ("mask", 2)):
        reward = Recorder()
        rollout = SampledRollout(
            objective, reward, 2, 4, greedy, decode=lambda ids: str(ids), truncation=mode
        )
        packed = rollout(state_at(known.variables, 0), batch, jax.random.key(0))
        assert len(reward.calls) == 4, mode  # the reward reads every completion regardless
        assert reward.calls[0][1] == "[3, 4, 5, 6]" and reward.calls[2][1] == "[6]"
        trained_sessions = np.unique(packed["session_index"][packed["response_mask"] == 1])
        assert trained_sessions.size == trained, mode
    # Under "zero" prompt 0's pair trains on reward 0 twice: equal rewards, no advantage.
    rollout = SampledRollout(objective, Recorder(), 2, 4, greedy, truncation="zero")
    packed = rollout(state_at(known.variables, 0), batch, jax.random.key(0))
    assert not packed["advantages"][:2].any() and packed["advantages"][2:].any()


def test_sampled_ids_record_raw_and_behavior_likelihoods(known):
    """old_log_probs: the raw model; behavior_log_probs: after temperature and top-k."""
    sampling = Sampling(temperature=0.7, top_k=3)
    objective = GRPOObjective(known.model, seq_len=7)
    rollout = SampledRollout(
        objective, lambda *a: 0.0, groups=4, max_new_tokens=5, sampling=sampling
    )
    packed = rollout(
        state_at(known.variables, 0), prompt_batch([[2, 3], [5]], 3), jax.random.key(1)
    )
    rows, columns = np.nonzero(packed["response_mask"])
    assert rows.size == 8 * 5  # no EOS configured: every completion uses the budget
    for r, c in zip(rows, columns, strict=True):
        previous, token = packed["input_ids"][r, c - 1], packed["input_ids"][r, c]
        logits = known.logits[previous]
        scaled = logits / 0.7
        kept = scaled >= np.sort(scaled)[-3]
        assert kept[token], "a top-k sampler drew an id outside the top 3"
        behavior = log_softmax(np.where(kept, scaled, -np.inf))[token]
        assert abs(packed["old_log_probs"][r, c] - log_softmax(logits)[token]) < 2e-6
        assert abs(packed["behavior_log_probs"][r, c] - behavior) < 2e-6
    assert (packed["old_log_probs"] != packed["behavior_log_probs"]).any()


def test_a_float32_twin_samples_for_a_bfloat16_update(known):
    """sample_model samples (and records likelihoods) in its own precision."""
    config = {**vars(known.model.config), "dtype": jnp.bfloat16}
    half = models.build("causal_transformer", **config)
    batch, key = prompt_batch([[2, 3], [5]], 3), jax.random.key(1)
    recorded = {}
    for name, twin in (("float32", known.model), ("bfloat16", None)):
        rollout = SampledRollout(
            GRPOObjective(half, seq_len=7), lambda *a: 0.0, groups=2, max_new_tokens=5,
            sampling=GREEDY, sample_model=twin,
        )  # fmt: skip
        packed = rollout(state_at(known.variables, 0), batch, key)
        rows, columns = np.nonzero(packed["response_mask"])
        previous = packed["input_ids"][rows, columns - 1]
        tokens = packed["input_ids"][rows, columns]
        pairs = zip(previous, tokens, strict=True)
        want = np.array([log_softmax(known.logits[p])[t] for p, t in pairs])
        recorded[name] = np.abs(packed["old_log_probs"][rows, columns] - want).max()
    assert recorded["float32"] < 2e-6  # the twin's float32 likelihoods
    assert recorded["bfloat16"] > 1e-5  # the objective's own model rounds its activations


def test_a_sample_model_that_is_not_a_twin_is_refused(known):
    objective = GRPOObjective(known.model, seq_len=7)
    wider = models.build("causal_transformer", **{**vars(known.model.config), "num_heads": 4})
    with pytest.raises(ValueError, match=r"num_heads=4 \(the objective's model: 2\)"):
        SampledRollout(objective, Recorder(), 2, 5, sample_model=wider)
    with pytest.raises(TypeError, match="sample_model is a str; expected a CausalTransformer"):
        SampledRollout(objective, Recorder(), 2, 5, sample_model="float32")


class Listed:
    """A reward that returns the given values in call order."""

    def __init__(self, values):
        self.values = list(values)

    def __call__(self, data_source, completion, ground_truth, extra_info):
        return self.values.pop(0)


@pytest.mark.parametrize("aggregation", ["token-mean", "session-mean"])
def test_dropping_zero_advantage_groups_leaves_the_update_as_it_was(known, aggregation):
    """Groups 0 and 2 are all-equal: without them the loss and its gradient are the same.

    Their completions carry advantage 0, so they add 0 to the policy loss's numerator; the
    kept advantages are scaled by the kept share of its denominator (tokens, or sessions).
    """
    batch = prompt_batch([[1, 2], [3, 4, 5], [1, 2], [3, 4, 5]], 3)
    objective = GRPOObjective(known.model, seq_len=6, aggregation=aggregation)
    rewards = [1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 2.0, 3.0]
    state, key = state_at(known.variables, 0), jax.random.key(0)
    hot = Sampling(eos_id=EOS, temperature=4.0)  # completions differ within a group
    keep = SampledRollout(objective, Listed(rewards), 2, 4, hot)
    drop = SampledRollout(
        objective, Listed(rewards), 2, 4, hot, drop_zero_advantage=True, row_multiple=3
    )
    full, kept = keep(state, batch, key), drop(state, batch, key)
    assert full["input_ids"].shape == (8, 7) and kept["input_ids"].shape[0] in (3, 6)
    trained = kept["session_index"][kept["response_mask"] == 1]
    assert sorted(set(trained.tolist())) == [2, 3, 6, 7]
    lengths = [s.calls[0].sampled_ids.size for s in keep.last_sessions]
    assert len(set(lengths)) > 1  # EOS at different places: the two shares differ
    if aggregation == "token-mean":
        share = sum(lengths[i] for i in (2, 3, 6, 7)) / sum(lengths)
    else:
        share = 4 / 8
    for i in (2, 3, 6, 7):  # the same chain, likelihoods and scaled advantage
        for name in ("input_ids", "old_log_probs", "behavior_log_probs", "advantages"):
            want = full[name][full["session_index"] == i]
            got = kept[name][kept["session_index"] == i]
            if name == "advantages":
                want = want * np.float32(share)
            np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=name)
    assert keep.metrics()["groups/zero_advantage"] == 0.5 == drop.metrics()["groups/zero_advantage"]
    assert keep.metrics()["rows"] == 8.0 and drop.metrics()["rows"] in (3.0, 6.0)
    assert [s.reward for s in drop.last_sessions] == rewards  # every completion is still seen

    def loss_and_grad(packed):
        fn = lambda p: objective.loss(p, packed, key)[0]  # noqa: E731
        return jax.value_and_grad(fn)(known.variables)

    (loss_full, g_full), (loss_kept, g_kept) = loss_and_grad(full), loss_and_grad(kept)
    np.testing.assert_allclose(loss_kept, loss_full, rtol=1e-5, atol=1e-7)  # both near 0
    norm = max(float(np.abs(g).max()) for g in jax.tree.leaves(g_full))
    assert norm > 1e-3  # the kept groups' completions differ, so they do not cancel
    for a, b in zip(jax.tree.leaves(g_full), jax.tree.leaves(g_kept), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6 * norm)


def test_a_batch_with_nothing_to_learn_keeps_one_multiple_of_padding(known):
    batch = prompt_batch([[1, 2], [3, 4, 5]], 3)
    objective = GRPOObjective(known.model, seq_len=6)
    rollout = SampledRollout(objective, lambda *a: 1.0, 2, 4, GREEDY, drop_zero_advantage=True)
    packed = rollout(state_at(known.variables, 0), batch, jax.random.key(0))
    assert packed["input_ids"].shape == (1, 7)  # an eighth of 4 completions, rounded up
    assert not packed["response_mask"].any()
    assert rollout.metrics()["groups/zero_advantage"] == 1.0
    loss, _ = objective.loss(known.variables, packed, jax.random.key(0))
    assert float(loss) == 0.0


def test_a_flat_group_trains_on_the_guides_reference(known):
    """Greedy sampling makes every group flat. Prompt 0's completions (3 4 5 6) are all
    wrong and the guide's reply (3 4 EOS) is right, so it replaces the group's last
    completion, with the policy's own likelihoods; prompt 1's are all right already, and
    prompt 2 has no reference."""
    batch = prompt_batch([[1, 2], [3, 4, 5], [1, 2]], 3, ground_truth=["3 4", "6", "none"])
    objective = GRPOObjective(known.model, seq_len=6)
    asked = []

    def guide(data_source, ground_truth, extra_info):
        asked.append(ground_truth)
        return None if ground_truth == "none" else [int(t) for t in ground_truth.split()] + [EOS]

    def reward(data_source, completion, ground_truth, extra_info):
        return float(completion == ground_truth)

    rollout = SampledRollout(objective, reward, 2, 4, GREEDY, guide=guide)
    packed = rollout(state_at(known.variables, 3), batch, jax.random.key(0))
    assert asked == ["3 4", "6", "none"]
    sessions = rollout.last_sessions
    assert [s.reward for s in sessions] == [0.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    reference = sessions[1]
    assert reference.calls[0].sampled_ids.tolist() == [3, 4, EOS]
    assert reference.status is Status.COMPLETED and reference.sample == 1
    assert sessions[0].calls[0].sampled_ids.tolist() == [3, 4, 5, 6]  # sampled, kept
    row = packed["session_index"] == 1
    assert packed["input_ids"][row.any(axis=1)][0][:5].tolist() == [1, 2, 3, 4, EOS]
    want = [log_softmax(known.logits[a])[b] for a, b in ((2, 3), (3, 4), (4, EOS))]
    np.testing.assert_allclose(packed["behavior_log_probs"][row], want, atol=1e-5)
    np.testing.assert_allclose(packed["old_log_probs"][row], want, atol=1e-5)
    np.testing.assert_array_equal(packed["versions"][row], 3)
    sampled = packed["session_index"] == 0  # greedy: its ids were certain
    np.testing.assert_array_equal(packed["behavior_log_probs"][sampled], 0.0)
    advantages = {i: float(packed["advantages"][packed["session_index"] == i][0]) for i in range(6)}
    assert advantages[0] < 0 < advantages[1]  # the reference wins its group
    assert advantages[2] == advantages[3] == advantages[4] == advantages[5] == 0.0
    metrics = rollout.metrics()
    assert metrics["groups/guided"] == pytest.approx(1 / 3)
    assert metrics["reward/mean"] == pytest.approx(2 / 6)  # the sampled completions'
    assert metrics["groups/zero_advantage"] == pytest.approx(2 / 3)


def test_groups_that_still_explore_are_left_to_sampling(known):
    """All wrong but not all alike (hot sampling): no reference goes in."""
    batch = prompt_batch([[1, 2], [3, 4, 5]], 3)
    objective = GRPOObjective(known.model, seq_len=6)
    hot = Sampling(eos_id=EOS, temperature=4.0)
    rollout = SampledRollout(objective, lambda *a: 0.0, 4, 4, hot, guide=lambda *a: [3, EOS])
    rollout(state_at(known.variables, 0), batch, jax.random.key(0))
    sessions = rollout.last_sessions
    replies = [
        {s.calls[0].sampled_ids.tobytes() for s in sessions[4 * g : 4 * g + 4]} for g in (0, 1)
    ]
    assert all(len(r) > 1 for r in replies)  # the premise: each group's replies differ
    assert rollout.metrics()["groups/guided"] == 0.0
    assert all(s.reward == 0.0 for s in sessions)


def test_bad_guides_are_refused_naming_the_prompt(known):
    objective = GRPOObjective(known.model, seq_len=6)
    batch = prompt_batch([[1, 2]], 3)
    zero = lambda *a: 0.0  # noqa: E731  every group all wrong: the guide is always asked
    with pytest.raises(TypeError, match="guide is 'ref'"):
        SampledRollout(objective, zero, 2, 4, GREEDY, guide="ref")
    with pytest.raises(ValueError, match="guide is set but sampling has no eos_id"):
        SampledRollout(objective, zero, 2, 4, Sampling(temperature=0), guide=lambda *a: [EOS])
    cases = [
        ([3, 4, 5, 6, EOS], ValueError, "guide returned 5 ids on prompt 0; expected 1 to max"),
        ([3, 4], ValueError, "ends in its only EOS id"),
        ([EOS, 3, EOS], ValueError, "ends in its only EOS id"),
        ([3, 9, EOS], ValueError, "ids in \\[3, 9\\] on prompt 0; expected ids in \\[0, 8\\)"),
        ([3.0, EOS], TypeError, "guide returned float64"),
        ([[3, EOS]], TypeError, "expected 1-D integer token ids"),
    ]
    for ids, error, match in cases:
        rollout = SampledRollout(objective, zero, 2, 4, GREEDY, guide=lambda *a, ids=ids: ids)
        with pytest.raises(error, match=match):
            rollout(state_at(known.variables, 0), batch, jax.random.key(0))

    def broken(*args):
        raise KeyError("answer")

    rollout = SampledRollout(objective, zero, 2, 4, GREEDY, guide=broken)
    with pytest.raises(RuntimeError, match="guide raised on prompt 0: KeyError") as raised:
        rollout(state_at(known.variables, 0), batch, jax.random.key(0))
    assert isinstance(raised.value.__cause__, KeyError)


# ----------------------------------------------------------------- failures


def test_groups_below_two_and_other_bad_settings_are_refused(known):
    objective = GRPOObjective(known.model, seq_len=6)
    reward = Recorder()
    with pytest.raises(ValueError, match="groups is 1; expected an int >= 2"):
        SampledRollout(objective, reward, groups=1, max_new_tokens=4)
    with pytest.raises(TypeError, match="groups"):
        SampledRollout(objective, reward, groups=2.0, max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens is 0"):
        SampledRollout(objective, reward, groups=2, max_new_tokens=0)
    with pytest.raises(ValueError, match="estimator is 'median'"):
        SampledRollout(objective, reward, 2, 4, estimator="median")
    with pytest.raises(ValueError, match="truncation is 'drop'"):
        SampledRollout(objective, reward, 2, 4, truncation="drop")
    with pytest.raises(TypeError, match="reward is 'dog'"):
        SampledRollout(objective, "dog", 2, 4)
    with pytest.raises(TypeError, match="sampling"):
        SampledRollout(objective, reward, 2, 4, sampling={"temperature": 1.0})
    with pytest.raises(ValueError, match="eos_id contains 9"):
        SampledRollout(objective, reward, 2, 4, sampling=Sampling(eos_id=9))
    with pytest.raises(TypeError, match="'model'"):
        SampledRollout(object(), reward, 2, 4)
    with pytest.raises(ValueError, match="row_multiple is 4 but drop_zero_advantage is False"):
        SampledRollout(objective, reward, 2, 4, row_multiple=4)
    with pytest.raises(ValueError, match="row_multiple is 0; expected None or an int >= 1"):
        SampledRollout(objective, reward, 2, 4, drop_zero_advantage=True, row_multiple=0)
    with pytest.raises(TypeError, match="drop_zero_advantage is 'yes'; expected a bool"):
        SampledRollout(objective, reward, 2, 4, drop_zero_advantage="yes")


@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda b: b.pop("prompt_length"), ValueError, "no field 'prompt_length'"),
        (
            lambda b: b.update(prompt=np.pad(b["prompt"], ((0, 0), (1, 0)))),
            ValueError,
            "= P \\+ R - 1 = 7",
        ),
        (lambda b: b.update(prompt_length=np.array([2, 4])), ValueError, "is 4 in row 1"),
        (lambda b: b.update(prompt=b["prompt"] * 1.0), ValueError, "'prompt' is float64"),
        (lambda b: b.update(ground_truth=np.zeros((3, 2), np.int32)), ValueError, "ground_truth"),
    ],
)
def test_bad_prompt_batches_are_refused_before_sampling(known, change, error, match):
    rollout = SampledRollout(GRPOObjective(known.model, seq_len=6), Recorder(), 2, 4)
    batch = prompt_batch([[1, 2], [3, 4, 5]], 3, ground_truth=["a", "b"])
    change(batch)
    with pytest.raises(error, match=match):
        rollout(state_at(known.variables, 0), batch, jax.random.key(0))


def failing_rewards():
    def raises(source, completion, truth, extra):
        if truth == "boom":
            raise KeyError("no such answer")
        return 1.0

    def nan_on_second(source, completion, truth, extra, seen=[]):  # noqa: B006
        seen.append(truth)
        return math.nan if truth == "boom" and seen.count("boom") == 2 else 0.0

    def text(source, completion, truth, extra):
        return "1.0" if truth == "boom" else 1.0

    return [
        (raises, RuntimeError, "reward raised on prompt 1, sample 0 .*KeyError"),
        (nan_on_second, ValueError, "reward returned nan on prompt 1, sample 1"),
        (text, TypeError, "reward returned str '1.0' on prompt 1, sample 0"),
        (lambda *a: True, TypeError, "reward returned bool True on prompt 0, sample 0"),
    ]


@pytest.mark.parametrize("reward, error, match", failing_rewards())
def test_reward_failures_name_the_prompt_and_sample(known, reward, error, match):
    rollout = SampledRollout(GRPOObjective(known.model, seq_len=6), reward, 2, 4, GREEDY)
    batch = prompt_batch([[1, 2], [3, 4, 5]], 3, ground_truth=["fine", "boom"])
    with pytest.raises(error, match=match) as caught:
        rollout(state_at(known.variables, 0), batch, jax.random.key(0))
    if error is RuntimeError:
        assert isinstance(caught.value.__cause__, KeyError)


def test_decode_failures_name_the_prompt_and_sample(known):
    objective = GRPOObjective(known.model, seq_len=6)
    batch = prompt_batch([[1, 2], [3, 4, 5]], 3)
    state = state_at(known.variables, 0)
    rollout = SampledRollout(objective, Recorder(), 2, 4, GREEDY, decode=lambda ids: ids)
    with pytest.raises(TypeError, match="decode returned list .* prompt 0, sample 0"):
        rollout(state, batch, jax.random.key(0))
    rollout = SampledRollout(objective, Recorder(), 2, 4, GREEDY, decode=lambda ids: 1 / 0)
    with pytest.raises(RuntimeError, match="decode raised on prompt 0, sample 0"):
        rollout(state, batch, jax.random.key(0))


# ----------------------------------------------------------------- through the Trainer


@pytest.mark.slow  # about 15 s on a shared 2-core machine: init, generate and update compiles
def test_trainer_trains_through_the_rollout_and_logs_its_metrics():
    model = models.build(
        "causal_transformer",
        vocab_size=13,
        emb_features=16,
        num_layers=1,
        num_heads=2,
        mlp_features=32,
        max_seq_len=16,
    )
    batch = prompt_batch([[4, 5, 6], [7, 8]], 3, ground_truth=["3", "9"])
    data = Dataset(train=lambda partition: itertools.repeat(batch), val=None, records=2, batch=2)
    objective = GRPOObjective(model, seq_len=7, beta=0.05)

    def reward(source, completion, truth, extra):
        return float(completion.split().count(truth))

    rollout = SampledRollout(
        objective, reward, groups=3, max_new_tokens=5, sampling=Sampling(eos_id=2)
    )
    records = []
    trainer = Trainer(
        objective, optax.adam(1e-2), key=jax.random.key(4), rollout=rollout, log=records.append
    )
    start = jax.device_get(trainer.initial_state().params)
    state = trainer.fit(data, steps=3, log_every=1)
    assert (int(state.step), int(state.updates)) == (3, 3)
    # The third draw ran under the weights of two updates and says so.
    assert {c.version for s in rollout.last_sessions for c in s.calls} == {2}
    assert len(rollout.last_sessions) == 6
    last = records[-1]
    for name, value in rollout.metrics().items():
        assert last[f"rollout/{name}"] == pytest.approx(value), name
    rewards = [s.reward for s in rollout.last_sessions]
    assert last["rollout/reward/mean"] == pytest.approx(np.mean(rewards))
    assert last["tokens"] == sum(s.calls[0].sampled_ids.size for s in rollout.last_sessions)
    moved = jax.tree.map(lambda a, b: np.abs(np.asarray(a) - b).max(), state.params, start)
    assert max(jax.tree.leaves(moved)) > 0


def test_trainer_refuses_a_rollout_that_reports_bad_metrics():
    from dew_pipe.training.loop import _rollout_metrics

    class Reporting:
        def __init__(self, values):
            self.values = values

        def metrics(self):
            return self.values

    assert _rollout_metrics(object()) == {}
    assert _rollout_metrics(Reporting({"a": 1, "b": np.float32(0.5)})) == {
        "rollout/a": 1.0,
        "rollout/b": 0.5,
    }
    with pytest.raises(TypeError, match=r"rollout.metrics\(\)\['a'\] is 'x'"):
        _rollout_metrics(Reporting({"a": "x"}))
    with pytest.raises(TypeError, match="returned list"):
        _rollout_metrics(Reporting([1.0]))


# ----------------------------------------------------------------- the spec's GRPO example


def dog_count(model, params, prompt, tokenizer, key) -> int:
    """How many of 128 completions (temperature 1, top-k 40, 8 ids) mention a dog."""
    from dew_pipe.inference import generate

    rows = np.tile(np.array(prompt, np.int32), (128, 1))
    lengths = np.full(128, len(prompt), np.int32)
    out = generate(model, params, rows, lengths, 8, key, Sampling(temperature=1.0, top_k=40))
    return sum("dog" in tokenizer.decode(ids.tolist()) for ids in np.asarray(out.ids))


@pytest.mark.slow
def test_spec_grpo_example_raises_the_share_of_dog_stories(story_tokenizer):
    from story_prelude import story_decoder

    # Prelude: the TinyStories section's model, lm_state, tokenizer and imports.
    model, lm_state, tokenizer = story_decoder(story_tokenizer)
    from dew_pipe import Dataset, Sampling, Trainer  # noqa: F401  # the example's imports

    # ---- the spec's example, with dew -> dew_pipe ----
    from dew_pipe.objectives.rl import GRPOObjective, SampledRollout

    prompt = tokenizer.encode("Once upon a time, there was a little")
    prompt_batch = {
        "prompt": np.tile(np.array(prompt, dtype=np.int32), (8, 1)),
        "prompt_length": np.full(8, len(prompt), dtype=np.int32),
        "data_source": np.tile(
            np.frombuffer(b"tinystories", dtype=np.uint8).astype(np.int32),
            (8, 1),
        ),
        "ground_truth": np.tile(
            np.frombuffer(b"dog", dtype=np.uint8).astype(np.int32),
            (8, 1),
        ),
        "extra_info": np.zeros((8, 0), dtype=np.int32),
    }

    def reward(data_source, completion, ground_truth, extra_info):
        return float(ground_truth in completion)

    rl_data = Dataset(
        train=lambda partition: itertools.repeat(prompt_batch),
        val=None,
        records=8,
        batch=8,
    )
    rl_objective = GRPOObjective(
        model,
        seq_len=len(prompt) + 7,
        beta=0.01,
        pretrained=lm_state.params,
    )
    rollout = SampledRollout(
        rl_objective,
        reward=reward,
        groups=4,
        max_new_tokens=8,
        sampling=Sampling(temperature=1.0, top_k=40),
        decode=tokenizer.decode,
    )
    rl_state = Trainer(
        rl_objective,
        optax.adamw(1e-4),
        key=jax.random.key(3),
        rollout=rollout,
    ).fit(rl_data, steps=20, log_every=10)
    # ---- end of the example ----

    assert (int(rl_state.step), int(rl_state.updates)) == (20, 20)
    key = jax.random.key(11)  # the same draws before and after: only the policy differs
    before = dog_count(model, lm_state.params, prompt, tokenizer, key)
    after = dog_count(model, rl_state.params, prompt, tokenizer, key)
    print(f"completions mentioning a dog: {before}/128 before, {after}/128 after")
    assert 4 <= before <= 24  # the corpus rate, about 1 in 10
    assert after >= 2 * before and after >= before + 16, (before, after)


def test_docstring_examples_run():
    import doctest

    import dew_pipe.inference.sampled_rollout as module

    result = doctest.testmod(module)
    assert result.attempted > 10 and result.failed == 0
