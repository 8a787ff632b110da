"""GRPO's accumulation weight: microbatches weighted by ``loss_weight`` equal the whole batch.

The Trainer averages microbatch gradients weighted by the objective's ``loss_weight``
(else ``tokens``). Under ``aggregation="token-mean"`` the loss is a mean over trainable
tokens, so the weight is the token count; under ``"session-mean"`` it is a mean over
sessions, so the weight must be the number of sessions with a trainable token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from grpo_helpers import WIDTH, single_call_sessions, tiny_decoder

from dew_pipe.objectives.rl import GRPOObjective, pack

_FILL = {"versions": -1, "session_index": -1, "call_index": -1}


def keep_rows(batch, rows):
    """``batch`` with every other row turned into padding: the same shape, one compile."""
    out = {}
    for name, column in batch.items():
        blank = np.full_like(column, _FILL.get(name, 0))
        blank[rows] = column[rows]
        out[name] = blank
    return out


@pytest.fixture(scope="module", params=["token-mean", "session-mean"])
def split(request):
    """Loss weight, tokens, sessions and gradient of microbatch A (row 0), B (the rest)
    and the whole batch; one-call sessions sit in one row each, so no session is split."""
    model = tiny_decoder()
    init = jax.jit(model.init)
    example = jnp.zeros((1, WIDTH - 1), jnp.int32)
    reference, policy = init(jax.random.key(0), example), init(jax.random.key(1), example)
    batch = pack(single_call_sessions(3, count=9), WIDTH)
    assert batch["input_ids"].shape[0] >= 2
    objective = GRPOObjective(model, seq_len=WIDTH - 1, beta=0.1, aggregation=request.param)
    grad = jax.jit(jax.value_and_grad(objective.loss, has_aux=True))
    rows = np.arange(batch["input_ids"].shape[0])
    out = {}
    for name, part in (("a", rows[:1]), ("b", rows[1:]), ("whole", rows)):
        part = keep_rows(batch, part)
        (_, metrics), g = grad(policy, part, jax.random.key(0), reference)
        sessions = np.unique(part["session_index"][part["response_mask"] == 1]).size
        out[name] = (float(metrics["loss_weight"]), float(metrics["tokens"]), sessions, g)
    return request.param, out


def mix(w1, g1, w2, g2):
    return jax.tree.map(lambda a, b: (w1 * a + w2 * b) / (w1 + w2), g1, g2)


def largest_gap(ours, full):
    return max(
        float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())
        for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(full), strict=True)
    )


def test_weighted_microbatches_equal_the_whole_batch(split):
    aggregation, out = split
    (w1, t1, s1, g1), (w2, t2, s2, g2), whole = out["a"], out["b"], out["whole"][3]
    if aggregation == "token-mean":
        assert (w1, w2) == (t1, t2)
    else:
        assert (w1, w2) == (s1, s2)
        assert t1 / (t1 + t2) != w1 / (w1 + w2), "the split must separate the two weightings"
        # ... and it does: token weights would give another gradient than the whole batch.
        assert largest_gap(mix(t1, g1, t2, g2), whole) > 1e-3
    assert largest_gap(mix(w1, g1, w2, g2), whole) <= 2e-6
