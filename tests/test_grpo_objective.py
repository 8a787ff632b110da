"""GRPOObjective on the project's decoder: scoring, the loss against NumPy, the reference,
bypass mode, validation, prompt perplexity and a short Trainer run."""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from grpo_helpers import (
    VOCAB,
    WIDTH,
    apply,
    chain_log_probs,
    perturbed,
    single_call_sessions,
    tiny_decoder,
)

from dew_pipe import Dataset, Trainer
from dew_pipe.objectives.rl import GRPOObjective
from dew_pipe.objectives.rl.packing import pack

SEQ = WIDTH - 1


@pytest.fixture(scope="module")
def model():
    return tiny_decoder()


@pytest.fixture(scope="module")
def variables(model):
    return model.init(jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32))


@pytest.fixture(scope="module")
def batch():
    return pack(single_call_sessions(1, count=6), WIDTH)


@pytest.fixture(scope="module")
def support_batch():
    sessions = single_call_sessions(2, count=5, support=True)
    # One session without a recorded support: its ids are scored over the whole vocabulary.
    # (As task 2: under its helper's identity, task 0 sample 0, it would be sessions[0] twice.)
    sessions += [dataclasses.replace(s, task=2) for s in single_call_sessions(3, count=1)]
    return pack(sessions, WIDTH, support_capacity=48)


def test_packed_log_probs_score_each_chain_alone(model, variables, batch):
    assert (batch["text_segment_ids"].max(axis=1) >= 2).any(), "no row holds two chains"
    objective = GRPOObjective(model, SEQ)
    ours = np.asarray(jax.jit(objective.packed_log_probs)(variables, batch))
    expected, _ = chain_log_probs(model, variables, batch)
    np.testing.assert_allclose(ours, expected, atol=2e-6, rtol=0)
    starts = (batch["text_positions"] == 0) | (batch["text_segment_ids"] == 0)
    assert (ours[starts] == 0).all() and (ours[~starts] < 0).all()


def test_sampling_temperature_renormalises_over_the_support(model, variables, support_batch):
    objective = GRPOObjective(model, SEQ, sampling_temperature=0.7)
    ours = np.asarray(jax.jit(objective.packed_log_probs)(variables, support_batch))
    _, logits = chain_log_probs(model, variables, support_batch, temperature=0.7)
    ids, columns = support_batch["support_ids"], support_batch["support_columns"]
    rows, width = support_batch["input_ids"].shape
    expected = np.zeros((rows, width))
    with_support = 0
    for r, c in itertools.product(range(rows), range(width)):
        if (
            c == 0
            or support_batch["text_positions"][r, c] == 0
            or support_batch["text_segment_ids"][r, c] == 0
        ):
            continue
        kept = ids[r][columns[r] == c]
        z = logits[r, c]
        token = support_batch["input_ids"][r, c]
        if kept.size:
            with_support += 1
            z = z[np.union1d(kept, [token])]
            expected[r, c] = logits[r, c, token] - np.log(np.exp(z).sum())
        else:
            expected[r, c] = logits[r, c, token] - np.log(np.exp(z).sum())
    assert with_support > 5
    np.testing.assert_allclose(ours, expected, atol=2e-6, rtol=0)
    # Without sampling_temperature the support is not read: the raw model scores.
    raw = np.asarray(GRPOObjective(model, SEQ).packed_log_probs(variables, support_batch))
    assert not np.allclose(raw, ours)


def numpy_ppo(log_prob, batch, ref=None, beta=0.0, low=0.2, high=0.2, dual=3.0):
    """Token-mean dual-clip PPO plus beta * k3, written out in NumPy."""
    mask = batch["response_mask"].astype(bool)
    lp, old, adv = log_prob[mask], batch["old_log_probs"][mask], batch["advantages"][mask]
    ratio = np.exp(np.clip(lp - old, -20, 20))
    loss = np.maximum(-adv * ratio, -adv * np.clip(ratio, 1 - low, 1 + high))
    loss = np.where(adv < 0, np.minimum(loss, -adv * dual), loss)
    total = loss.mean()
    if beta:
        d = np.clip(ref[mask] - lp, -20, 20)
        total += beta * np.clip(np.exp(d) - d - 1, -10, 10).mean()
    return total


def test_loss_matches_numpy(model, variables, batch):
    reference = perturbed(variables, 0.05, seed=7)
    objective = GRPOObjective(model, SEQ, beta=0.04, epsilon_high=0.28, pretrained=variables)
    loss, metrics = jax.jit(objective.loss)(variables, batch, jax.random.key(0), reference)
    log_prob, _ = chain_log_probs(model, variables, batch)
    ref, _ = chain_log_probs(model, reference, batch)
    expected = numpy_ppo(log_prob, batch, ref, beta=0.04, high=0.28)
    assert float(loss) == pytest.approx(expected, abs=2e-6)
    assert float(metrics["kl_loss"]) > 0
    assert float(metrics["tokens"]) == batch["response_mask"].sum()
    assert float(metrics["loss"]) == pytest.approx(float(loss))
    for name in ("pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "entropy"):
        assert np.isfinite(float(metrics[name])), name
    mask = batch["response_mask"].astype(bool)
    behavior, old = batch["behavior_log_probs"][mask], batch["old_log_probs"][mask]
    assert float(metrics["mismatch/kl"]) == pytest.approx(np.mean(behavior - old), abs=1e-6)
    lr = old - behavior
    assert float(metrics["mismatch/k3_kl"]) == pytest.approx(np.mean(np.exp(lr) - lr - 1), abs=1e-6)
    w = np.exp(lr)
    assert float(metrics["mismatch/ess"]) == pytest.approx(
        1 / np.mean((w / w.mean()) ** 2), abs=1e-5
    )


def test_frozen_reference_only_with_beta(model, variables, batch):
    plain = GRPOObjective(model, SEQ)
    assert plain.ema_decay is None
    _, metrics = jax.jit(plain.loss)(variables, batch, jax.random.key(0), None)
    assert "kl_loss" not in metrics
    start = perturbed(variables, 0.05, seed=3)
    kl = GRPOObjective(model, SEQ, beta=0.1, pretrained=start)
    assert kl.ema_decay == 1.0
    init = kl.init(jax.random.key(5))
    for a, c in zip(jax.tree.leaves(init), jax.tree.leaves(start), strict=True):
        np.testing.assert_array_equal(a, c)
        assert a is not c
    with pytest.raises(ValueError, match="ema"):
        kl.loss(variables, batch, jax.random.key(0), None)
    _, same = jax.jit(kl.loss)(start, batch, jax.random.key(0), start)
    assert float(same["kl_loss"]) == 0.0


def test_bypass_mode_without_old_log_probs(model, variables, batch):
    """Without old_log_probs behavior stands in; a copy of behavior means the same."""
    objective = GRPOObjective(model, SEQ, behavior_importance=(0.6, 1.5), sequence_mask=(0.2, 5.0))
    missing = {k: v for k, v in batch.items() if k != "old_log_probs"}
    copied = dict(batch, old_log_probs=batch["behavior_log_probs"].copy())
    loss_fn = jax.jit(jax.value_and_grad(objective.loss, has_aux=True))
    (a, ma), ga = loss_fn(variables, missing, jax.random.key(0), None)
    (b, mb), gb = loss_fn(variables, copied, jax.random.key(0), None)
    assert float(a) == float(b)
    for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb), strict=True):
        np.testing.assert_array_equal(x, y)
    # The band masks by the current policy over behavior (verl's token_k1 rejection).
    log_prob, _ = chain_log_probs(model, variables, batch)
    mask = batch["response_mask"].astype(bool)
    ratio = np.exp(log_prob[mask] - batch["behavior_log_probs"][mask])
    outside = np.mean((ratio < 0.6) | (ratio > 1.5))
    assert 0 < outside < 1
    assert float(ma["mask/band"]) == pytest.approx(outside, abs=1e-6)
    assert float(ma["tokens"]) <= mask.sum() * (1 - outside) + 1e-6
    # A TIS cap needs recorded old log-probs: refused at trace time and by validate.
    capped = GRPOObjective(model, SEQ, behavior_importance=2.0)
    with pytest.raises(ValueError, match="old_log_probs"):
        jax.jit(capped.loss)(variables, missing, jax.random.key(0), None)
    with pytest.raises(ValueError, match="old_log_probs"):
        capped.validate(missing)
    with pytest.raises(ValueError, match="stand in"):
        capped.validate(copied)
    capped.validate(batch)


def shifted(batch, name):
    out = dict(batch)
    out[name] = np.roll(batch[name], 1, axis=1)
    return out


BAD = [
    (
        "no behavior",
        lambda b: {k: v for k, v in b.items() if k != "behavior_log_probs"},
        "behavior_log_probs",
    ),
    ("behavior off by one", lambda b: shifted(b, "behavior_log_probs"), "misaligned"),
    (
        "NaN behavior",
        lambda b: dict(
            b, behavior_log_probs=np.where(b["response_mask"] == 1, np.nan, 0).astype(np.float32)
        ),
        "behavior_log_probs",
    ),
    (
        "NaN old",
        lambda b: dict(
            b, old_log_probs=np.where(b["response_mask"] == 1, np.inf, 0).astype(np.float32)
        ),
        "old_log_probs",
    ),
    (
        "sampled chain start",
        lambda b: dict(b, response_mask=np.ones_like(b["response_mask"])),
        "response_mask",
    ),
    ("mask value", lambda b: dict(b, response_mask=b["response_mask"] * 2), "response_mask"),
    ("id beyond vocab", lambda b: dict(b, input_ids=b["input_ids"] + VOCAB), "input_ids"),
    ("float ids", lambda b: dict(b, input_ids=b["input_ids"].astype(np.float32)), "input_ids"),
    ("too narrow", lambda b: {k: v[:, :-1] for k, v in b.items()}, "input_ids"),
    ("misshapen old", lambda b: dict(b, old_log_probs=b["old_log_probs"][:, :-1]), "old_log_probs"),
    ("NaN advantage", lambda b: dict(b, advantages=b["advantages"] * np.nan), "advantages"),
    (
        "negative segment",
        lambda b: dict(b, text_segment_ids=b["text_segment_ids"] - 1),
        "text_segment_ids",
    ),
]


def test_proximal_in_step_equals_rescoring_under_the_same_weights(model, variables, batch):
    """In-step proximal likelihoods give the loss and gradients of a rescored batch."""
    current = perturbed(variables, 0.05, seed=3)  # not the policy that sampled the batch
    options = dict(behavior_importance=2.0, sequence_mask=(0.2, 5.0))
    rescoring = GRPOObjective(model, SEQ, **options)
    in_step = GRPOObjective(model, SEQ, proximal_in_step=True, **options)
    rescored = dict(batch, old_log_probs=np.asarray(rescoring.packed_log_probs(current, batch)))
    stale = dict(batch, old_log_probs=batch["old_log_probs"] - 0.7)  # ignored in step
    missing = {k: v for k, v in batch.items() if k != "old_log_probs"}
    loss_fn = jax.jit(jax.value_and_grad(rescoring.loss, has_aux=True))
    step_fn = jax.jit(jax.value_and_grad(in_step.loss, has_aux=True))
    (want, want_m), want_g = loss_fn(current, rescored, jax.random.key(0), None)
    assert float(want_m["tokens"]) > 0 and float(jnp.abs(want)) > 0
    for fed in (stale, missing):
        in_step.validate(fed)  # a TIS cap needs no recorded old log-probs here
        (got, got_m), got_g = step_fn(current, fed, jax.random.key(0), None)
        np.testing.assert_allclose(float(got), float(want), rtol=1e-5, atol=1e-7)
        for name in ("tokens", "mask/band"):
            if name in want_m:
                np.testing.assert_allclose(got_m[name], want_m[name], rtol=1e-6)
        for x, y in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g), strict=True):
            np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)
    # The rescored objective on the stale column is a different loss: the option matters.
    (other, _), _ = loss_fn(current, stale, jax.random.key(0), None)
    assert abs(float(other) - float(want)) > 1e-4
    with pytest.raises(TypeError, match="proximal_in_step"):
        GRPOObjective(model, SEQ, proximal_in_step="yes")


@pytest.mark.parametrize("name, corrupt, field", BAD, ids=[b[0] for b in BAD])
def test_validate_refuses_bad_batches(model, batch, name, corrupt, field):
    objective = GRPOObjective(model, SEQ)
    objective.validate(batch)
    with pytest.raises(ValueError, match=field):
        objective.validate(corrupt(batch))


def test_validate_session_mean_and_support(model, batch, support_batch):
    session_mean = GRPOObjective(model, SEQ, aggregation="session-mean")
    session_mean.validate(batch)
    with pytest.raises(ValueError, match="session_index"):
        session_mean.validate({k: v for k, v in batch.items() if k != "session_index"})
    objective = GRPOObjective(model, SEQ, sampling_temperature=0.7)
    objective.validate(support_batch)
    columns = support_batch["support_columns"].copy()
    columns[0, 0] = 0  # column 0 is never a sampled id
    with pytest.raises(ValueError, match="support_columns"):
        objective.validate(dict(support_batch, support_columns=columns))
    with pytest.raises(ValueError, match="support_ids"):
        objective.validate(
            dict(support_batch, support_ids=support_batch["support_ids"] + VOCAB * 2)
        )
    with pytest.raises(ValueError, match="partner"):
        objective.validate({k: v for k, v in support_batch.items() if k != "support_ids"})


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"seq_len": WIDTH + 4}, "max_seq_len"),
        ({"seq_len": 0}, "seq_len"),
        ({"sampling_temperature": 0.0}, "sampling_temperature"),
        ({"beta": -1.0}, "beta"),
        ({"policy_loss": "reinforce"}, "policy_loss"),
        ({"kl_estimator": "k4"}, "kl_estimator"),
        ({"pretrained": {"params": {"embed": np.zeros((2, 2))}}}, "pretrained"),
        ({"pretrained": {"embed": np.zeros((2, 2))}}, "params"),
    ],
)
def test_constructor_refuses_bad_options(model, kwargs, match):
    kwargs = {"seq_len": SEQ, **kwargs}
    with pytest.raises(ValueError, match=match):
        GRPOObjective(model, **kwargs)


def test_evaluate_scores_prompt_perplexity(model, variables, batch):
    objective = GRPOObjective(model, SEQ)
    lengths = np.array([5, 3, 1, 8], np.int32)
    prompt = np.zeros((4, 8), np.int32)
    rng = np.random.default_rng(0)
    for r, n in enumerate(lengths):
        prompt[r, 8 - n :] = rng.integers(1, VOCAB, n)
    prompts = {"prompt": prompt, "prompt_length": lengths}
    objective.validate(prompts)
    sums = jax.jit(objective.evaluate)(variables, prompts)
    # Reference: each prompt moved to column 0, its padding after it (segment 0).
    alone = np.zeros((4, WIDTH), np.int32)
    for r, n in enumerate(lengths):
        alone[r, :n] = prompt[r, 8 - n :]
    logits = np.asarray(
        apply(model, variables, alone, (np.arange(WIDTH) < lengths[:, None]).astype(np.int32))
    )
    logits = logits.astype(np.float64)
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    nll = -sum(
        logits[r, k - 1, alone[r, k]] - lse[r, k - 1]
        for r, n in enumerate(lengths)
        for k in range(1, n)
    )
    assert float(sums["tokens"]) == (lengths - 1).clip(0).sum()
    assert float(sums["nll"]) == pytest.approx(nll, abs=1e-4)
    report = objective.summarize({k: float(v) for k, v in sums.items()})
    assert report["perplexity"] == pytest.approx(np.exp(nll / 13), rel=1e-5)
    # Packed batches count the transitions the sampler did not draw.
    packed = jax.jit(objective.evaluate)(variables, batch)
    log_prob, _ = chain_log_probs(model, variables, batch)
    counted = (log_prob != 0) & (batch["response_mask"] == 0)
    assert float(packed["tokens"]) == counted.sum()
    assert float(packed["nll"]) == pytest.approx(-log_prob[counted].sum(), abs=1e-4)
    with pytest.raises(ValueError, match="0 prompt transitions"):
        objective.summarize({"nll": 0.0, "tokens": 0.0})
    with pytest.raises(ValueError, match="prompt_length"):
        objective.validate({"prompt": prompt, "prompt_length": lengths + 1})
    with pytest.raises(ValueError, match="SampledRollout"):
        objective.loss(variables, prompts, jax.random.key(0), None)


def test_trains_with_the_trainer(model, variables, batch):
    """A few Trainer updates on one packed batch raise its advantage-weighted likelihood
    and leave the frozen reference untouched."""
    start = perturbed(variables, 0.0, seed=0)
    objective = GRPOObjective(model, SEQ, beta=0.01, pretrained=start)
    data = Dataset(
        train=lambda partition: itertools.repeat(batch),
        val=None,
        records=None,
        batch=batch["input_ids"].shape[0],
    )
    trainer = Trainer(objective, optax.adam(3e-2), key=jax.random.key(1))
    state = trainer.fit(data, steps=4, log_every=100)
    assert int(state.updates) == 4
    for a, b in zip(jax.tree.leaves(state.ema), jax.tree.leaves(start), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=0)
    before, _ = chain_log_probs(model, start, batch)
    after, _ = chain_log_probs(model, state.params, batch)
    mask = batch["response_mask"].astype(bool)
    gain = ((after - before) * batch["advantages"])[mask].sum()
    assert gain > 0


def test_support_scoring_gradient_matches_a_dense_mask(model, variables, support_batch):
    """The segment-reduction scoring has the gradient of masking the vocabulary to -inf."""
    objective = GRPOObjective(model, SEQ, sampling_temperature=0.7)
    weights = jnp.asarray(np.random.default_rng(0).normal(size=support_batch["input_ids"].shape))

    def dense(params):
        ids = support_batch["input_ids"]
        logits = model.apply(params, ids[:, :-1], support_batch["text_segment_ids"][:, :-1]) / 0.7
        rows, steps, vocab = logits.shape
        keep = np.zeros((rows, steps, vocab), bool)
        present = np.zeros((rows, steps), bool)
        for r, k in zip(*np.nonzero(support_batch["support_columns"] >= 1), strict=True):
            c = support_batch["support_columns"][r, k]
            keep[r, c - 1, support_batch["support_ids"][r, k]] = True
            present[r, c - 1] = True
        keep |= ~present[..., None]
        keep |= np.eye(vocab, dtype=bool)[ids[:, 1:]]
        log_probs = jax.nn.log_softmax(jnp.where(keep, logits, -jnp.inf), axis=-1)
        picked = jnp.take_along_axis(log_probs, jnp.asarray(ids[:, 1:, None]), axis=-1)[..., 0]
        scorable = (
            support_batch["text_segment_ids"][:, 1:] == support_batch["text_segment_ids"][:, :-1]
        ) & (support_batch["text_segment_ids"][:, 1:] > 0)
        return jnp.sum(jnp.where(scorable, picked, 0.0) * weights[:, 1:])

    def ours(params):
        return jnp.sum(objective.packed_log_probs(params, support_batch) * weights)

    value, grad = jax.jit(jax.value_and_grad(ours))(variables)
    expected, expected_grad = jax.jit(jax.value_and_grad(dense))(variables)
    assert float(value) == pytest.approx(float(expected), abs=1e-5)
    for a, b in zip(jax.tree.leaves(grad), jax.tree.leaves(expected_grad), strict=True):
        assert np.isfinite(np.asarray(a)).all()
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)
