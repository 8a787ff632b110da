"""LMObjective: target masking by hand count, the loss against NumPy, validation, SFT example."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew_pipe import Dataset, LMObjective, Trainer, models
from dew_pipe.data.chat import Role
from dew_pipe.objectives.lm import target_mask

VOCAB = 40
SEQ_LEN = 6  # rows carry 7 ids

# Two rows packed by hand. Row 0: documents 1 and 2, then one padding id. Row 1: left padding,
# then one document. Roles: 1 system, 2 user, 3 assistant, 0 none.
SEGMENTS = np.array([[1, 1, 1, 2, 2, 2, 0], [0, 0, 1, 1, 1, 1, 1]], np.int32)
POSITIONS = np.array([[0, 1, 2, 0, 1, 2, 0], [0, 0, 0, 1, 2, 3, 4]], np.int32)
ROLES = np.array([[1, 2, 3, 2, 3, 3, 0], [0, 0, 2, 2, 3, 3, 3]], np.int8)
# Target j (id j + 1) counts when ids j and j + 1 share a real document:
#   row 0: (1,1) (1,1) (1,2)x (2,2) (2,2) (2,0)x      -> 1 1 0 1 1 0
#   row 1: (0,0)x (0,1)x (1,1) (1,1) (1,1) (1,1)       -> 0 0 1 1 1 1
HAND_ALL = np.array([[1, 1, 0, 1, 1, 0], [0, 0, 1, 1, 1, 1]], bool)
# ... and, for assistant targets only, target roles are ROLES[:, 1:]:
#   row 0: 2 3 2 3 3 0 -> 0 1 0 1 1 0;  row 1: 0 2 2 3 3 3 -> 0 0 0 1 1 1
HAND_ASSISTANT = np.array([[0, 1, 0, 1, 1, 0], [0, 0, 0, 1, 1, 1]], bool)


def packed_batch(seed=0):
    text = np.random.default_rng(seed).integers(1, VOCAB, SEGMENTS.shape).astype(np.int32)
    return {
        "text": text,
        "text_segment_ids": SEGMENTS,
        "text_positions": POSITIONS,
        "text_roles": ROLES,
    }


@pytest.fixture(scope="module")
def model():
    return models.build(
        "causal_transformer",
        vocab_size=VOCAB,
        emb_features=16,
        num_layers=1,
        num_heads=2,
        mlp_features=32,
        max_seq_len=8,
    )


@pytest.fixture(scope="module")
def variables(model):
    return model.init(jax.random.key(0), jnp.zeros((1, SEQ_LEN), jnp.int32))


@pytest.fixture(scope="module")
def objectives(model):
    return {
        "all": LMObjective(model, SEQ_LEN, ema_decay=None),
        "assistant": LMObjective(model, SEQ_LEN, loss_role=Role.ASSISTANT, ema_decay=None),
    }


@pytest.fixture(scope="module")
def loss_fns(objectives):
    """One compiled loss per objective, shared by the tests below."""
    return {
        name: jax.jit(lambda p, b, o=objective: o.loss(p, b, jax.random.key(0)))
        for name, objective in objectives.items()
    }


def numpy_nll(logits, targets):
    """Per-position negative log-likelihood in float64."""
    logits = np.asarray(logits, np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    log_z = np.log(np.exp(shifted).sum(axis=-1))
    picked = np.take_along_axis(shifted, targets[..., None], axis=-1)[..., 0]
    return log_z - picked


def test_mask_matches_the_hand_count():
    mask = target_mask(SEGMENTS, ROLES, None, (2, SEQ_LEN))
    np.testing.assert_array_equal(mask, HAND_ALL)
    mask = target_mask(SEGMENTS, ROLES, int(Role.ASSISTANT), (2, SEQ_LEN))
    np.testing.assert_array_equal(mask, HAND_ASSISTANT)
    assert target_mask(None, None, None, (2, SEQ_LEN)).all()


@pytest.mark.parametrize(("name", "hand"), [("all", HAND_ALL), ("assistant", HAND_ASSISTANT)])
def test_loss_matches_numpy(model, variables, loss_fns, name, hand):
    batch = packed_batch()
    loss, metrics = loss_fns[name](variables, batch)
    logits = model.apply(
        variables,
        batch["text"][:, :-1],
        segment_ids=SEGMENTS[:, :-1],
        positions=POSITIONS[:, :-1],
    )
    nll = numpy_nll(logits, batch["text"][:, 1:])
    assert float(metrics["tokens"]) == hand.sum()  # 8 and 6 by hand
    np.testing.assert_allclose(float(loss), nll[hand].mean(), rtol=1e-6)
    predicted = np.argmax(np.asarray(logits), axis=-1) == batch["text"][:, 1:]
    np.testing.assert_allclose(float(metrics["accuracy"]), predicted[hand].mean(), rtol=1e-6)


def test_uncounted_targets_do_not_move_the_loss(variables, loss_fns):
    batch = packed_batch()
    changed = {k: v.copy() for k, v in batch.items()}
    # Padding ids: the trailing one is only an uncounted target; the leading ones are
    # uncounted targets and inputs that nothing attends to.
    for row, column in ((0, 6), (1, 0), (1, 1)):
        changed["text"][row, column] = (batch["text"][row, column] + 1) % VOCAB
    np.testing.assert_array_equal(
        loss_fns["all"](variables, batch)[0], loss_fns["all"](variables, changed)[0]
    )
    changed["text"][1, 5] = (batch["text"][1, 5] + 1) % VOCAB  # a counted target
    assert loss_fns["all"](variables, batch)[0] != loss_fns["all"](variables, changed)[0]


def test_rows_without_segments_count_every_target(model, variables, objectives):
    text = packed_batch()["text"]
    loss, metrics = objectives["all"].loss(variables, {"text": text}, jax.random.key(0))
    nll = numpy_nll(model.apply(variables, text[:, :-1]), text[:, 1:])
    assert float(metrics["tokens"]) == text.shape[0] * SEQ_LEN
    np.testing.assert_allclose(float(loss), nll.mean(), rtol=1e-6)


def test_a_row_with_nothing_counted_gives_zero_loss(variables, loss_fns):
    batch = dict(packed_batch(), text_roles=np.zeros_like(ROLES))
    loss, metrics = loss_fns["assistant"](variables, batch)
    assert float(loss) == 0.0 and float(metrics["tokens"]) == 0.0


def test_evaluate_and_perplexity(model, variables, objectives):
    objective = objectives["assistant"]
    batches = [packed_batch(0), packed_batch(1)]
    totals = {}
    for batch in batches:
        for name, value in objective.evaluate(variables, batch).items():
            totals[name] = totals.get(name, 0.0) + float(value)
    nll = np.concatenate(
        [
            numpy_nll(
                model.apply(
                    variables,
                    b["text"][:, :-1],
                    segment_ids=SEGMENTS[:, :-1],
                    positions=POSITIONS[:, :-1],
                ),
                b["text"][:, 1:],
            )[HAND_ASSISTANT]
            for b in batches
        ]
    )
    assert totals["tokens"] == 2 * HAND_ASSISTANT.sum()
    np.testing.assert_allclose(totals["nll"], nll.sum(), rtol=1e-6)
    summary = objective.summarize(totals)
    np.testing.assert_allclose(summary["loss"], nll.mean(), rtol=1e-6)
    np.testing.assert_allclose(summary["perplexity"], np.exp(nll.mean()), rtol=1e-6)
    assert summary["tokens"] == totals["tokens"]
    with pytest.raises(ValueError, match="validation counted 0 target tokens"):
        objective.summarize({"nll": 0.0, "tokens": 0.0, "correct": 0.0})


# ------------------------------------------------------------------------- validation


def test_loss_role_needs_text_roles(variables, objectives):
    objective = objectives["assistant"]
    batch = {"text": packed_batch()["text"]}
    with pytest.raises(ValueError, match=r"no field 'text_roles'; LMObjective\(loss_role=3\)"):
        objective.validate(batch)
    with pytest.raises(ValueError, match="no field 'text_roles'"):
        objective.loss(variables, batch, jax.random.key(0))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"text": np.zeros((2, 5), np.int32)}, r"'text' has shape \(2, 5\); .*expects \[B, 7\]"),
        ({"text": np.zeros((2, 7), np.float32)}, r"'text' has dtype float32; expected integers"),
        (
            {"text": np.full((2, 7), VOCAB, np.int32)},
            rf"token id {VOCAB}; expected ids in \[0, 40\)",
        ),
        ({"text": np.full((2, 7), -1, np.int32)}, r"token id -1"),
        ({"text_roles": ROLES[:, :5]}, r"'text_roles' has shape \(2, 5\); expected .*\(2, 7\)"),
        ({"text_segment_ids": -SEGMENTS}, r"'text_segment_ids' holds -2; expected values >= 0"),
    ],
)
def test_validate_names_the_field(objectives, change, message):
    batch = dict(packed_batch(), **change)
    with pytest.raises(ValueError, match=message):
        objectives["all"].validate(batch)


def test_validate_accepts_a_good_batch(objectives):
    batch = packed_batch()
    before = {name: np.array(value, copy=True) for name, value in batch.items()}
    assert objectives["assistant"].validate(batch) is None
    assert batch.keys() == before.keys()
    for name, value in before.items():  # validation reads the batch, never rewrites it
        np.testing.assert_array_equal(batch[name], value)


def test_trainer_refuses_a_bad_batch_before_compiling_the_update(model):
    objective = LMObjective(model, SEQ_LEN, ema_decay=None)
    wide = {"text": np.zeros((2, 9), np.int32)}
    data = Dataset(train=lambda p: itertools.repeat(wide), val=None, batch=2)
    with pytest.raises(ValueError, match=r"'text' has shape \(2, 9\)"):
        Trainer(objective, optax.sgd(0.1), key=jax.random.key(0)).fit(data, steps=1)


def test_constructor_errors(model, variables):
    with pytest.raises(ValueError, match=r"seq_len=9 exceeds the model's max_seq_len=8"):
        LMObjective(model, 9)
    with pytest.raises(ValueError, match=r"seq_len=0; expected an int >= 1"):
        LMObjective(model, 0)
    with pytest.raises(TypeError, match=r"loss_role='assistant'"):
        LMObjective(model, SEQ_LEN, loss_role="assistant")
    with pytest.raises(ValueError, match=r"ema_decay=2.0; expected None or a float in \[0, 1\]"):
        LMObjective(model, SEQ_LEN, ema_decay=2.0)
    with pytest.raises(TypeError, match="expected a Flax linen Module"):
        LMObjective(object(), SEQ_LEN)
    with pytest.raises(ValueError, match="expected a full variables mapping"):
        LMObjective(model, SEQ_LEN, pretrained=variables["params"])
    broken = jax.tree.map(lambda x: x, variables)
    broken["params"]["embed"] = jnp.zeros((VOCAB + 1, 16))
    with pytest.raises(ValueError, match=r"pretrained\['params'\]\['embed'\] has shape \(41, 16\)"):
        LMObjective(model, SEQ_LEN, pretrained=broken)
    missing = {"params": {k: v for k, v in variables["params"].items() if k != "embed"}}
    with pytest.raises(ValueError, match=r"pretrained lacks \['params'\]\['embed'\]"):
        LMObjective(model, SEQ_LEN, pretrained=missing)


def test_init_copies_pretrained_and_random_init_is_seeded(model, variables):
    objective = LMObjective(model, SEQ_LEN, pretrained=variables)
    copy = objective.init(jax.random.key(5))
    for a, b in zip(jax.tree.leaves(copy), jax.tree.leaves(variables), strict=True):
        np.testing.assert_array_equal(a, b)
        assert a.unsafe_buffer_pointer() != b.unsafe_buffer_pointer()
    fresh = LMObjective(model, SEQ_LEN)
    assert fresh.ema_decay == 0.999
    init = jax.jit(fresh.init)
    a, b, c = init(jax.random.key(1)), init(jax.random.key(1)), init(jax.random.key(2))
    np.testing.assert_array_equal(a["params"]["embed"], b["params"]["embed"])
    assert not np.array_equal(a["params"]["embed"], c["params"]["embed"])


# ------------------------------------------------------------------------- the spec's SFT


@pytest.mark.slow
def test_spec_sft_example_runs_and_learns_the_answer():
    from dew_pipe.data import build_tokenizer, generate_stories

    # Prelude: the spec's "TinyStories decoder" (model, lm_state, tokenizer), kept tiny.
    tokenizer = build_tokenizer(generate_stories(200), vocab_size=300)
    model = models.build(
        "causal_transformer",
        vocab_size=len(tokenizer),
        emb_features=32,
        num_layers=1,
        num_heads=2,
        mlp_features=64,
        max_seq_len=32,
    )
    # Pretraining is not what this test is about: a fresh state stands in for lm_state.
    lm_state = Trainer(
        LMObjective(model, 32), optax.adamw(1e-3), key=jax.random.key(1)
    ).initial_state()
    lm_params = jax.tree.map(lambda x: np.array(x, copy=True), lm_state.params)

    # ---- the spec's example, with dew -> dew_pipe ----
    from dew_pipe import Dataset as Dataset_  # the example's imports, by their spec paths
    from dew_pipe.data.chat import Role as Role_

    prompt = tokenizer.encode("Tom had a red ball.")
    response = tokenizer.encode(" He kicked it to his dog.")
    row = np.array(prompt + response, dtype=np.int32)
    roles = np.array([Role_.USER] * len(prompt) + [Role_.ASSISTANT] * len(response), dtype=np.int8)
    sft_batch = {"text": np.tile(row, (8, 1)), "text_roles": np.tile(roles, (8, 1))}
    sft_data = Dataset_(
        train=lambda partition: itertools.repeat(sft_batch),
        val=None,
        records=8,
        batch=8,
    )
    sft_objective = LMObjective(
        model,
        seq_len=len(row) - 1,
        pretrained=lm_state.params,
        loss_role=Role_.ASSISTANT,
        ema_decay=None,
    )
    sft_state = Trainer(
        sft_objective,
        optax.adamw(1e-3),
        key=jax.random.key(2),
    ).fit(sft_data, steps=20, log_every=10)
    # ---- end of the example ----

    assert (int(sft_state.step), int(sft_state.updates)) == (20, 20)
    assert sft_state.ema is None
    # lm_state stays usable for the DPO and GRPO examples that follow (no donation).
    for a, b in zip(jax.tree.leaves(lm_state.params), jax.tree.leaves(lm_params), strict=True):
        np.testing.assert_array_equal(a, b)
    evaluate = jax.jit(sft_objective.evaluate)
    before = evaluate(lm_params, sft_batch)
    after = evaluate(sft_state.params, sft_batch)
    assert float(before["tokens"]) == 8 * len(response)  # assistant targets only
    assert float(after["nll"]) < 0.85 * float(before["nll"])  # measured: 0.78
