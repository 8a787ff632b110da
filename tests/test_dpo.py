"""DPOObjective: parity with TRL 1.16, a NumPy reference, the spec's examples, a learning check.

The TRL fixture (tests/parity/record_trl_dpo.py) holds a tiny Llama policy and a different
reference, four tokenized pairs, and TRL's sigmoid DPO loss, logged metrics, per-pair
log-probabilities and parameter gradients for them.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew_pipe import Trainer, models
from dew_pipe.data import Loading, PreferencePairs
from dew_pipe.data.synthetic import VOCAB, digit_preferences
from dew_pipe.models import load_pretrained
from dew_pipe.objectives.rl import DPOObjective
from dew_pipe.objectives.rl.dpo import sequence_log_probs

FIXTURES = Path(__file__).parent / "parity" / "fixtures" / "trl_dpo"
MULTI_DEVICE = Path(__file__).with_name("multi_device_dpo.py")


# ---------------------------------------------------------------- parity with TRL


@pytest.fixture(scope="module")
def trl():
    """TRL's recorded numbers, our models and batch, and our loss/metrics/gradients."""
    meta = json.loads((FIXTURES / "pairs.json").read_text())
    recorded = dict(np.load(FIXTURES / "dpo.npz"))
    policy, reference = (
        load_pretrained(FIXTURES / "policy"),
        load_pretrained(FIXTURES / "reference"),
    )
    width = meta["seq_len"]
    records = tuple(json.dumps(row) for row in meta["records"])
    batch = PreferencePairs(records=records, seq_len=width, shuffle=False).pairs()
    objective = DPOObjective(policy.model, seq_len=width - 1, beta=meta["beta"])
    grad = jax.jit(jax.value_and_grad(objective.loss, has_aux=True))
    (loss, metrics), grads = grad(policy.variables, batch, jax.random.key(0), reference.variables)
    return types.SimpleNamespace(
        meta=meta,
        recorded=recorded,
        policy=policy,
        reference=reference,
        objective=objective,
        records=records,
        batch=batch,
        apply=jax.jit(policy.model.apply),
        loss=float(loss),
        metrics={k: float(v) for k, v in metrics.items()},
        grads=policy.export(grads, dtype=np.float32),
    )


def test_loss_matches_trl(trl):
    assert abs(trl.loss - float(trl.recorded["loss"])) <= 1e-6


def test_gradients_match_trl(trl):
    recorded = {
        k.removeprefix("grad/"): v for k, v in trl.recorded.items() if k.startswith("grad/")
    }
    assert sorted(trl.grads) == sorted(recorded)
    for name, ours in trl.grads.items():
        theirs = recorded[name]
        assert ours.shape == theirs.shape, name
        scale = np.abs(theirs).max()
        assert scale > 0, f"{name}: TRL's gradient is all zero; the fixture checks nothing"
        assert np.abs(ours - theirs).max() <= 1e-5 * scale, name


def test_accumulation_weight_makes_microbatches_equal_the_whole_batch(trl):
    """The Trainer weights microbatch gradients by ``loss_weight``: pairs, not tokens, for DPO.

    Splitting the four pairs 1 + 3 gives microbatches with different token counts, so a
    token-weighted average would differ from the full-batch gradient.
    """
    grad = jax.jit(jax.value_and_grad(trl.objective.loss, has_aux=True))

    def run(rows):
        part = {k: v[rows] for k, v in trl.batch.items()}
        (_, metrics), g = grad(
            trl.policy.variables, part, jax.random.key(0), trl.reference.variables
        )
        return float(metrics["loss_weight"]), float(metrics["tokens"]), g

    (w1, t1, g1), (w2, t2, g2) = run(slice(0, 1)), run(slice(1, 4))
    assert (w1, w2) == (1.0, 3.0)
    assert t1 / (t1 + t2) != w1 / (w1 + w2), "the split must separate the two weightings"
    combined = jax.tree.map(lambda a, b: (w1 * a + w2 * b) / (w1 + w2), g1, g2)
    whole = trl.policy.export(combined, dtype=np.float32)
    for name, ours in whole.items():
        full = trl.grads[name]
        assert np.abs(ours - full).max() <= 1e-5 * np.abs(full).max(), name


def test_log_probs_and_metrics_match_trl(trl):
    both = jax.jit(trl.objective._pair_log_probs)
    for variables, key in (
        (trl.policy.variables, "policy_logps"),
        (trl.reference.variables, "ref_logps"),
    ):
        np.testing.assert_allclose(
            np.asarray(both(variables, trl.batch)), trl.recorded[key], rtol=1e-5
        )
    for name in (
        "rewards/chosen",
        "rewards/rejected",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
    ):
        theirs = float(trl.recorded[f"metric/{name}"])
        assert abs(trl.metrics[name] - theirs) <= 1e-5 * max(1.0, abs(theirs)), name
    # Wins are counted strictly; the fixture has 3 of 4.
    assert (
        trl.metrics["rewards/accuracies"]
        == float(trl.recorded["metric/rewards/accuracies"])
        == 0.75
    )
    assert trl.metrics["tokens"] == float(trl.batch["completion_mask"][:, :, 1:].sum())


def test_extra_padding_changes_nothing(trl):
    wider = PreferencePairs(records=trl.records, seq_len=trl.meta["seq_len"] + 3, shuffle=False)
    objective = DPOObjective(trl.policy.model, seq_len=trl.meta["seq_len"] + 2, beta=0.1)
    loss, _ = jax.jit(objective.loss)(
        trl.policy.variables, wider.pairs(), jax.random.key(0), trl.reference.variables
    )
    assert abs(float(loss) - trl.loss) <= 1e-6


def test_reference_receives_no_gradient(trl):
    def by_reference(ema):
        return trl.objective.loss(trl.policy.variables, trl.batch, jax.random.key(0), ema)[0]

    grads = jax.jit(jax.grad(by_reference))(trl.reference.variables)
    assert all(not np.any(np.asarray(leaf)) for leaf in jax.tree.leaves(grads))


def test_unmoved_policy_has_zero_rewards_and_no_wins(trl):
    loss, metrics = jax.jit(trl.objective.loss)(
        trl.policy.variables, trl.batch, jax.random.key(0), trl.policy.variables
    )
    assert abs(float(loss) - math.log(2.0)) <= 1e-7
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert float(metrics[name]) == 0.0, name


# ---------------------------------------------------------------- NumPy reference


def _numpy_sums(logits: np.ndarray, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Summed log p(ids[t] | ids[:t]) over t >= 1 with mask[t] == 1, from full-row logits."""
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    out = np.zeros(len(ids))
    for row in range(len(ids)):
        for t in range(1, ids.shape[1]):
            if mask[row, t]:
                out[row] += log_probs[row, t - 1, ids[row, t]]
    return out


def test_sequence_log_probs_follow_the_target_mask(trl):
    model, variables = trl.policy.model, trl.policy.variables
    ids = trl.batch["input_ids"].reshape(-1, trl.meta["seq_len"])
    mask = trl.batch["completion_mask"].reshape(ids.shape).copy()
    logits = np.asarray(trl.apply(variables, ids), np.float64)
    expected = _numpy_sums(logits, ids, mask)
    score = jax.jit(lambda m: sequence_log_probs(model, variables, ids, m))
    np.testing.assert_allclose(np.asarray(score(mask)), expected, rtol=1e-5)
    mask[:, 0] = 1  # position 0 has no predictor: marking it changes nothing
    np.testing.assert_allclose(np.asarray(score(mask)), expected, rtol=1e-5)
    mask[0, 1:] = 0
    mask[0, 2] = 1  # the mask of the target, not of the input, picks the prediction
    assert float(score(mask)[0]) == pytest.approx(_numpy_sums(logits, ids, mask)[0], rel=1e-5)


def test_evaluate_scores_chosen_answers(trl):
    objective = trl.objective
    sums = jax.jit(objective.evaluate)(trl.policy.variables, trl.batch)
    chosen = trl.batch["input_ids"][:, 0]
    mask = trl.batch["completion_mask"][:, 0]
    logits = np.asarray(trl.apply(trl.policy.variables, chosen), np.float64)
    nll = -_numpy_sums(logits, chosen, mask).sum()
    assert float(sums["nll"]) == pytest.approx(nll, rel=1e-5)
    assert float(sums["tokens"]) == mask[:, 1:].sum()
    report = objective.summarize({k: float(v) for k, v in sums.items()})
    assert report["perplexity"] == pytest.approx(math.exp(nll / mask[:, 1:].sum()), rel=1e-5)
    with pytest.raises(ValueError, match="0 chosen completion tokens"):
        objective.summarize({"nll": 0.0, "tokens": 0.0})


def test_one_forward_pass_per_side_for_policy_and_reference(trl):
    class Counting:
        """Wraps the decoder and records the shape of every apply call."""

        def __init__(self, model):
            self.model, self.config, self.calls = model, model.config, []

        def init(self, *args, **kwargs):
            return self.model.init(*args, **kwargs)

        def apply(self, variables, tokens, *args, **kwargs):
            self.calls.append(tuple(tokens.shape))
            return self.model.apply(variables, tokens, *args, **kwargs)

    counting = Counting(trl.policy.model)
    objective = DPOObjective(counting, seq_len=trl.meta["seq_len"] - 1, beta=0.1)
    jax.eval_shape(
        jax.grad(
            lambda p: objective.loss(p, trl.batch, jax.random.key(0), trl.reference.variables)[0]
        ),
        trl.policy.variables,
    )
    pairs, width = trl.batch["input_ids"].shape[0], trl.meta["seq_len"]
    assert counting.calls == [(2 * pairs, width - 1)] * 2


# ---------------------------------------------------------------- bad input


@pytest.fixture(scope="module")
def tiny():
    return models.build(
        "causal_transformer",
        vocab_size=8,
        emb_features=16,
        num_layers=1,
        num_heads=2,
        mlp_features=32,
        max_seq_len=4,
    )


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"beta": 0.0}, ValueError, r"beta is 0.0; expected a finite float > 0"),
        ({"beta": -0.1}, ValueError, "beta is -0.1"),
        ({"beta": float("nan")}, ValueError, "beta is nan"),
        ({"beta": float("inf")}, ValueError, "beta is inf"),
        ({"beta": True}, TypeError, "beta is bool"),
        ({"beta": "0.1"}, TypeError, "beta is str"),
        ({"beta": 0.1, "ema_decay": 0.99}, ValueError, r"ema_decay is 0.99; .*fixed at 1.0"),
        ({"beta": 0.1, "ema_decay": None}, ValueError, "ema_decay is None"),
        ({"beta": 0.1, "seq_len": 5}, ValueError, "exceeds the model's max_seq_len=4"),
        ({"beta": 0.1, "pretrained": {"w": 1}}, ValueError, "full variables mapping"),
    ],
)
def test_constructor_refuses(tiny, kwargs, error, match):
    kwargs = {"seq_len": 3, **kwargs}
    with pytest.raises(error, match=match):
        DPOObjective(tiny, **kwargs)


def test_ema_decay_is_fixed_at_one(tiny):
    assert DPOObjective(tiny, seq_len=3, beta=0.1).ema_decay == 1.0
    assert DPOObjective(tiny, seq_len=3, beta=0.1, ema_decay=1.0).ema_decay == 1.0


def _good_batch() -> dict[str, np.ndarray]:
    ids = np.array([[[1, 2, 3, 5], [1, 2, 4, 5]]] * 2, np.int32)
    mask = np.array([[[0, 0, 1, 1], [0, 0, 1, 1]]] * 2, np.int32)
    return {"input_ids": ids, "completion_mask": mask}


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda b: b.pop("completion_mask"), "no field 'completion_mask'"),
        (
            lambda b: b.update(input_ids=b["input_ids"][:, :, :3]),
            r"shape \(2, 2, 3\); .* \[B, 2, 4\]",
        ),
        (lambda b: b.update(input_ids=b["input_ids"][:, :1]), r"shape \(2, 1, 4\)"),
        (lambda b: b.update(input_ids=b["input_ids"].astype(np.float32)), "dtype float32"),
        (
            lambda b: b["input_ids"].__setitem__((0, 0, 0), 8),
            r"token id 8; expected ids in \[0, 8\)",
        ),
        (lambda b: b["input_ids"].__setitem__((0, 0, 0), -1), "token id -1"),
        (lambda b: b["completion_mask"].__setitem__((1, 1, 2), 2), "'completion_mask' holds 2"),
    ],
)
def test_validate_refuses(tiny, change, match):
    objective = DPOObjective(tiny, seq_len=3, beta=0.1)
    objective.validate(_good_batch())
    batch = _good_batch()
    change(batch)
    with pytest.raises(ValueError, match=match):
        objective.validate(batch)


def test_loss_needs_the_reference(tiny):
    objective = DPOObjective(tiny, seq_len=3, beta=0.1)
    params = jax.eval_shape(objective.init, jax.random.key(0))
    with pytest.raises(ValueError, match="ema is None"):
        jax.eval_shape(lambda p: objective.loss(p, _good_batch(), jax.random.key(0), None), params)


# ---------------------------------------------------------------- the spec's examples

COMPLETE_EXAMPLE = """
import json

import jax
import numpy as np
import optax

from dew_pipe import Trainer, models
from dew_pipe.data import Loading, PreferencePairs
from dew_pipe.objectives.rl import DPOObjective

rows = [
    {
        "chosen": [1, 2, 3, 5],
        "rejected": [1, 2, 4, 5],
        "chosen_mask": [0, 0, 1, 1],
        "rejected_mask": [0, 0, 1, 1],
    },
    {
        "chosen": [1, 6, 3, 5],
        "rejected": [1, 6, 4, 5],
        "chosen_mask": [0, 0, 1, 1],
        "rejected_mask": [0, 0, 1, 1],
    },
]
row_width = 4
spec = PreferencePairs(
    records=tuple(json.dumps(row) for row in rows * 4),
    seq_len=row_width,
    pad_id=0,
    loading=Loading(workers=0, threads=1, read_buffer=2),
)
data = spec.load(batch=8)
model = models.build(
    "causal_transformer",
    vocab_size=8,
    emb_features=16,
    num_layers=1,
    num_heads=2,
    mlp_features=32,
    max_seq_len=row_width,
)
objective = DPOObjective(model, seq_len=row_width - 1, beta=0.1)
trainer = Trainer(objective, optax.adam(1e-3), key=jax.random.key(0))
initial = trainer.initial_state()
# Copy the snapshot to host memory before training donates device buffers.
reference = jax.tree.map(lambda x: np.array(x, copy=True), initial.ema)
state = trainer.fit(data, steps=2, log_every=1)
assert int(state.step) == 2
for before, after in zip(
    jax.tree.leaves(reference), jax.tree.leaves(state.ema), strict=True
):
    np.testing.assert_allclose(before, np.asarray(after), rtol=0, atol=1e-6)
print("Completed", int(state.updates), "DPO updates; reference stayed fixed.")
"""


@pytest.mark.slow
def test_spec_complete_offline_example(capsys):
    namespace: dict = {"__name__": "__main__"}
    exec(compile(COMPLETE_EXAMPLE, "spec_dpo_example", "exec"), namespace)
    assert "Completed 2 DPO updates; reference stayed fixed." in capsys.readouterr().out
    state, initial = namespace["state"], namespace["initial"]
    assert int(state.updates) == 2
    moved = [
        np.abs(np.asarray(a) - np.asarray(b)).max()
        for a, b in zip(jax.tree.leaves(initial.params), jax.tree.leaves(state.params), strict=True)
    ]
    assert max(moved) > 1e-4  # the policy learned while the reference stayed


PREFERENCE_SNIPPET = """
import json

from dew_pipe.data import PreferencePairs
from dew_pipe.objectives.rl import DPOObjective

rejected = tokenizer.encode(" He kicked kicked kicked it.")
pair = {"chosen": prompt + response, "rejected": prompt + rejected,
        "chosen_mask": [0] * len(prompt) + [1] * len(response),
        "rejected_mask": [0] * len(prompt) + [1] * len(rejected)}
pairs = PreferencePairs(records=(json.dumps(pair),) * 8, seq_len=16,
                        loading=Loading(workers=0, threads=1, read_buffer=2)).load(batch=8)
dpo = DPOObjective(model, seq_len=15, beta=0.1, pretrained=lm_state.params)
dpo_state = Trainer(dpo, optax.adam(0.001), key=jax.random.key(2)).fit(
    pairs, steps=10, log_every=5)
"""


@pytest.mark.slow
def test_spec_preference_optimization_snippet(story_tokenizer):
    """The spec's DPO continuation of the SFT session, with a small stand-in decoder."""
    model = models.build(
        "causal_transformer",
        vocab_size=len(story_tokenizer),
        emb_features=16,
        num_layers=1,
        num_heads=2,
        mlp_features=32,
        max_seq_len=16,
    )
    lm_state = types.SimpleNamespace(
        params=model.init(jax.random.key(1), jnp.zeros((1, 4), jnp.int32))
    )
    namespace = {
        "tokenizer": story_tokenizer,
        "model": model,
        "lm_state": lm_state,
        "prompt": story_tokenizer.encode("Tom had a red ball."),
        "response": story_tokenizer.encode(" He kicked it to his dog."),
        "Loading": Loading,
        "Trainer": Trainer,
        "optax": optax,
        "jax": jax,
    }
    exec(compile(PREFERENCE_SNIPPET, "spec_preference_snippet", "exec"), namespace)
    state = namespace["dpo_state"]
    assert int(state.updates) == 10
    for start, frozen in zip(
        jax.tree.leaves(lm_state.params), jax.tree.leaves(state.ema), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(start), np.asarray(frozen))


# ---------------------------------------------------------------- learning check


@pytest.mark.slow
def test_dpo_learns_the_digit_sorting_preference():
    """From scratch, 150 steps of 32 pairs; held-out accuracy measured ~95% (benchmark: more)."""
    width = 14  # 6 digits, separator, 6 answer digits, end token
    train = tuple(json.dumps(r) for r in digit_preferences(4096, max_digits=6, seed=0))
    held = tuple(json.dumps(r) for r in digit_preferences(512, max_digits=6, seed=1))
    pairs = PreferencePairs(records=train, seq_len=width, val_records=held)
    data = pairs.load(batch=32)
    model = models.build(
        "causal_transformer",
        vocab_size=VOCAB,
        emb_features=64,
        num_layers=2,
        num_heads=4,
        mlp_features=128,
        max_seq_len=width,
    )
    objective = DPOObjective(model, seq_len=width - 1, beta=0.5)
    logs: list[dict] = []
    trainer = Trainer(
        objective, optax.adam(3e-3), key=jax.random.key(0), log=logs.append, progress=False
    )
    start = trainer.initial_state()
    before = trainer.evaluate(start, data)
    state = trainer.fit(data, steps=150, log_every=50)
    rewards = jax.jit(objective.rewards)
    held_batch = pairs.pairs("val")
    chosen, rejected = rewards(start.params, start.ema, held_batch)
    assert float(jnp.mean(chosen > rejected)) == 0.0  # unmoved: no wins
    chosen, rejected = rewards(state.params, state.ema, held_batch)
    accuracy = float(jnp.mean(chosen > rejected))
    assert accuracy >= 0.85, accuracy
    after = trainer.evaluate(state, data)
    assert after["perplexity"] < before["perplexity"]  # chosen answers became likelier
    train_logs = [r for r in logs if "rewards/accuracies" in r]
    assert train_logs[-1]["rewards/accuracies"] > train_logs[0]["rewards/accuracies"]
    assert train_logs[-1]["loss"] < 0.3
    for begin, end in zip(jax.tree.leaves(start.ema), jax.tree.leaves(state.ema), strict=True):
        np.testing.assert_array_equal(np.asarray(begin), np.asarray(end))


@pytest.mark.slow
def test_eight_simulated_devices_train_like_one():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    env["JAX_PLATFORMS"] = "cpu"
    result = subprocess.run(
        [sys.executable, str(MULTI_DEVICE)], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ok" in result.stdout
