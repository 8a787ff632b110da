"""Packed GRPO equals GRPO over the unmerged chains, one call per row, gradients included.

The packed batch comes from ``pack``: calls that extend their chain merge into it, and
several chains share a row. The references are built without ``pack``: every call alone
in its own row (its prompt then its draw), or every chain of the packed batch moved alone
to its own row. Token-level options must agree with the one-call rows; options that pool
over a chain (GSPO's sequence ratio, the sequence masks) with the one-chain rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from grpo_helpers import (
    WIDTH,
    assert_same,
    multi_call_sessions,
    one_call_per_row,
    one_chain_per_row,
    perturbed,
    tiny_decoder,
)
from grpo_helpers import loss_and_grads as grads

from dew_pipe.objectives.rl import GRPOObjective
from dew_pipe.objectives.rl.packing import pack, session_chains

SEQ = WIDTH - 1


@pytest.fixture(scope="module")
def setup():
    model = tiny_decoder()
    variables = model.init(jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32))
    # Move the policy off the recorded likelihoods' scale so clipping and masks engage.
    policy = perturbed(variables, 0.3, seed=1)
    sessions = multi_call_sessions(4)
    packed = pack(sessions, WIDTH)
    merged = sum(len(c) > 1 for s in sessions for c in session_chains(s.calls))
    split = sum(len(session_chains(s.calls)) > 1 for s in sessions)
    assert merged and split, "the sessions need merged calls and split sessions"
    assert (packed["text_segment_ids"].max(axis=1) >= 2).any(), "no row holds two chains"
    mask = packed["response_mask"] == 1
    advantage = {
        int(i): float(a)
        for i, a in zip(packed["session_index"][mask], packed["advantages"][mask], strict=True)
    }
    calls = one_call_per_row(sessions, advantage, WIDTH)
    chains = one_chain_per_row(packed)
    return model, variables, policy, packed, calls, chains


TOKEN_LEVEL = {
    "ppo_band_kl": dict(beta=0.05, epsilon_high=0.28, behavior_importance=(0.7, 1.4)),
    "cispo_tis_sessions": dict(
        policy_loss="cispo", dual_clip=None, behavior_importance=1.5, aggregation="session-mean"
    ),
}
CHAIN_LEVEL = {
    "gspo_masks_sessions": dict(
        policy_loss="gspo",
        dual_clip=None,
        aggregation="session-mean",
        sequence_mask=(0.3, 3.0),
        geometric_mask=(0.7, 1.4),
    ),
}


@pytest.mark.parametrize("case", sorted(TOKEN_LEVEL))
def test_packed_equals_one_call_per_row(setup, case):
    model, variables, policy, packed, calls, _ = setup
    objective = GRPOObjective(model, SEQ, **TOKEN_LEVEL[case])
    ema = variables if objective.beta > 0 else None
    ours = grads(objective, policy, packed, ema)
    assert_same(ours, grads(objective, policy, calls, ema))
    if "mask/band" in ours[1]:
        assert 0 < ours[1]["mask/band"] < 1


@pytest.mark.parametrize("case", sorted(CHAIN_LEVEL))
def test_packed_equals_one_chain_per_row(setup, case):
    model, _, policy, packed, calls, chains = setup
    objective = GRPOObjective(model, SEQ, **CHAIN_LEVEL[case])
    ours = grads(objective, policy, packed, None)
    assert_same(ours, grads(objective, policy, chains, None))
    assert 0 < ours[1]["mask/sequence"] < 1 or 0 < ours[1]["mask/geometric"] < 1
    # Pooling is per chain, not per call: the one-call rows give another loss.
    assert abs(grads(objective, policy, calls, None)[0] - ours[0]) > 1e-4


def test_bypass_packed_equals_one_chain_per_row(setup):
    """Without old_log_probs (behavior stands in), the band and masks read the current policy."""
    model, variables, policy, packed, _, chains = setup
    objective = GRPOObjective(
        model, SEQ, beta=0.05, behavior_importance=(0.7, 1.4), sequence_mask=(0.2, 5.0)
    )

    def bypass(batch):
        return {k: v for k, v in batch.items() if k != "old_log_probs"}

    ours = grads(objective, policy, bypass(packed), variables)
    assert_same(ours, grads(objective, policy, bypass(chains), variables))
    assert 0 < ours[1]["mask/band"] < 1
