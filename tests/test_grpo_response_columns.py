"""`GRPOObjective(response_columns=K)`: the head on each row's sampled ids only.

The same loss, metrics and gradients as scoring every column, on packed rows where calls
merge and several chains share a row; a batch whose rows hold more sampled ids than ``K``
takes the whole-row head in that step and says so; the gathered head really is the one
that runs when the rows fit.
"""

from __future__ import annotations

import grpo_helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from grpo_helpers import (
    CHAIN,
    OPTIONS,
    VOCAB,
    WIDTH,
    multi_call_sessions,
    perturbed,
    single_call_sessions,
)
from grpo_helpers import loss_and_grads as run
from grpo_helpers import tiny_decoder as decoder

from dew_pipe.objectives.rl import GRPOObjective, PPOObjective, ValueHead
from dew_pipe.objectives.rl.packing import pack

SEQ = WIDTH - 1


@pytest.fixture(scope="module")
def setup():
    model = decoder()
    variables = model.init(jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32))
    policy = perturbed(variables, 0.3, seed=1)
    packed = pack(multi_call_sessions(4), WIDTH)
    most = int((packed["response_mask"] == 1).sum(axis=1).max())
    assert (packed["text_segment_ids"].max(axis=1) >= 2).any(), "no row holds two chains"
    assert 1 < most <= SEQ - 3, f"the rows hold up to {most} sampled ids of {SEQ}"
    return model, variables, policy, packed, most


def assert_same(ours, whole):
    grpo_helpers.assert_same(ours, whole, extra=("response_columns_overflow",))


@pytest.mark.parametrize("spare", [0, 3])
def test_gathered_head_equals_whole_rows(setup, spare):
    model, variables, policy, packed, most = setup
    whole = run(GRPOObjective(model, SEQ, **OPTIONS), policy, packed, variables)
    objective = GRPOObjective(model, SEQ, response_columns=most + spare, **OPTIONS)
    ours = run(objective, policy, packed, variables)
    assert_same(ours, whole)
    assert ours[1]["response_columns_overflow"] == 0.0
    assert 0 < ours[1]["mask/band"] < 1  # the band engages, so the ratios are compared too


@pytest.mark.parametrize("overflow", [False, True])
def test_a_deeper_decoder_agrees_too(setup, overflow):
    """Two layers: the last block runs on the sampled columns alone (the first on every
    column); loss, metrics and gradients still equal the whole rows', fallback included."""
    _, _, _, packed, most = setup
    model = decoder(num_layers=2)
    variables = model.init(jax.random.key(3), jnp.zeros((1, SEQ), jnp.int32))
    policy = perturbed(variables, 0.3, seed=4)
    whole = run(GRPOObjective(model, SEQ, **OPTIONS), policy, packed, variables)
    columns = most - 1 if overflow else most
    objective = GRPOObjective(model, SEQ, response_columns=columns, **OPTIONS)
    ours = run(objective, policy, packed, variables)
    assert_same(ours, whole)
    assert ours[1]["response_columns_overflow"] == float(overflow)


class _Delegate:
    """Another model with the split call forms (not a CausalTransformer): the head alone
    runs on the gathered columns, after a whole-row forward pass."""

    def __init__(self, model):
        self.inner, self.config = model, model.config
        self.features = self.logits = model.features

    def init(self, *args, **kwargs):
        return self.inner.init(*args, **kwargs)

    def apply(self, *args, **kwargs):
        return self.inner.apply(*args, **kwargs)


@pytest.mark.parametrize("overflow", [False, True])
def test_other_models_gather_after_the_forward_pass(setup, overflow):
    model, variables, policy, packed, most = setup
    whole = run(GRPOObjective(model, SEQ, **OPTIONS), policy, packed, variables)
    columns = most - 1 if overflow else most
    objective = GRPOObjective(_Delegate(model), SEQ, response_columns=columns, **OPTIONS)
    ours = run(objective, policy, packed, variables)
    assert_same(ours, whole)
    assert ours[1]["response_columns_overflow"] == float(overflow)


def test_chain_pooled_options_agree(setup):
    model, _, policy, packed, most = setup
    whole = run(GRPOObjective(model, SEQ, **CHAIN), policy, packed, None)
    ours = run(GRPOObjective(model, SEQ, response_columns=most, **CHAIN), policy, packed, None)
    assert_same(ours, whole)
    assert 0 < ours[1]["mask/sequence"] < 1 or 0 < ours[1]["mask/geometric"] < 1


def test_rows_over_the_columns_take_the_whole_head(setup):
    model, variables, policy, packed, most = setup
    whole = run(GRPOObjective(model, SEQ, **OPTIONS), policy, packed, variables)
    objective = GRPOObjective(model, SEQ, response_columns=most - 1, **OPTIONS)
    ours = run(objective, policy, packed, variables)
    assert_same(ours, whole)
    assert ours[1]["response_columns_overflow"] == 1.0


def test_the_head_runs_on_the_gathered_columns(setup):
    """When the rows fit, the logits computed are [N, K, V], not [N, W - 1, V]."""
    model, variables, policy, packed, most = setup
    objective = GRPOObjective(model, SEQ, response_columns=most, **OPTIONS)
    text = str(jax.make_jaxpr(objective.loss)(policy, packed, jax.random.key(0), variables))
    rows = packed["input_ids"].shape[0]
    assert f"f32[{rows},{most},{VOCAB}]" in text
    # the fallback branch still holds the whole-row head; without the option it is all there is
    assert f"f32[{rows},{SEQ},{VOCAB}]" in text
    plain = GRPOObjective(model, SEQ, **OPTIONS)
    plain_text = str(jax.make_jaxpr(plain.loss)(policy, packed, jax.random.key(0), variables))
    assert f"f32[{rows},{most},{VOCAB}]" not in plain_text


def test_support_batches_are_scored_whole(setup):
    """Recorded supports index whole rows: such a batch runs the whole-row head."""
    model, variables, policy, _, _ = setup
    batch = pack(single_call_sessions(5, support=True), WIDTH, support_capacity=48)
    assert "support_ids" in batch
    most = int((batch["response_mask"] == 1).sum(axis=1).max())
    whole = run(GRPOObjective(model, SEQ, **OPTIONS), policy, batch, variables)
    ours = run(
        GRPOObjective(model, SEQ, response_columns=most, **OPTIONS), policy, batch, variables
    )
    assert_same(ours, whole)
    assert ours[1]["response_columns_overflow"] == 0.0


def test_prompt_scores_are_untouched(setup):
    """packed_log_probs and evaluate still score every column."""
    model, _, policy, packed, most = setup
    plain = GRPOObjective(model, SEQ, **OPTIONS)
    ours = GRPOObjective(model, SEQ, response_columns=most, **OPTIONS)
    np.testing.assert_array_equal(
        np.asarray(ours.packed_log_probs(policy, packed)),
        np.asarray(plain.packed_log_probs(policy, packed)),
    )
    a, b = ours.evaluate(policy, packed), plain.evaluate(policy, packed)
    assert float(a["tokens"]) > 0 and float(a["nll"]) == float(b["nll"])


def test_ppo_passes_the_columns_to_its_actor(setup):
    model, _, _, _, most = setup
    objective = PPOObjective(model, SEQ, ValueHead(decoder()), response_columns=most)
    assert objective.actor.response_columns == most


@pytest.mark.parametrize("value", [0, -2, SEQ + 1, True, 2.5, "4"])
def test_bad_response_columns(setup, value):
    model = setup[0]
    with pytest.raises(ValueError, match=rf"response_columns={value!r}; expected None or an int"):
        GRPOObjective(model, SEQ, response_columns=value)


def test_response_columns_needs_the_split_call_forms():
    class Plain:  # init/apply only, as a generic Flax module offers
        def init(self, *args):
            return {}

        def apply(self, *args):
            return None

    with pytest.raises(TypeError, match="needs a model with 'features' and 'logits'"):
        GRPOObjective(Plain(), SEQ, response_columns=4)
    assert GRPOObjective(Plain(), SEQ).response_columns is None
