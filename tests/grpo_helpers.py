"""Small decoders, sessions and NumPy references for the GRPO objective tests.

Imported by tests/test_grpo_objective.py, tests/test_packed_grpo.py and
tests/test_grpo_response_columns.py; it must not import pytest. Everything here is deterministic from a NumPy seed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dew_pipe import models
from dew_pipe.objectives.rl.sessions import Call, Session

VOCAB = 13
WIDTH = 16

# Options under which the loss reads log-probabilities in every way it can: a KL term, an
# asymmetric clip, an importance band, a sampling temperature, the proximal pass in step.
OPTIONS = dict(
    beta=0.05,
    epsilon_high=0.28,
    behavior_importance=(0.7, 1.4),
    sampling_temperature=0.8,
    proximal_in_step=True,
)
# options that pool over a chain read the per-token log-probabilities through the masks
CHAIN = dict(
    policy_loss="gspo",
    dual_clip=None,
    aggregation="session-mean",
    sequence_mask=(0.3, 3.0),
    geometric_mask=(0.7, 1.4),
)


def tiny_decoder(num_layers: int = 1, max_seq_len: int = WIDTH):
    """The project's decoder at test size (one layer unless asked, 13 ids, 16 positions
    unless asked)."""
    return models.build(
        "causal_transformer",
        vocab_size=VOCAB,
        emb_features=16,
        num_layers=num_layers,
        num_heads=2,
        mlp_features=32,
        max_seq_len=max_seq_len,
    )


def perturbed(variables, scale: float, seed: int):
    """``variables`` plus Gaussian noise of ``scale`` (another policy close to the first)."""
    leaves, tree = jax.tree.flatten(variables)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    noisy = [
        x + scale * jax.random.normal(k, x.shape, x.dtype)
        for x, k in zip(leaves, keys, strict=True)
    ]
    return jax.tree.unflatten(tree, noisy)


def draw(
    rng: np.random.Generator, prompt, n: int, *, raw: bool = True, support: bool = False
) -> Call:
    """A call drawing ``n`` ids with made-up behavior (and raw) log-probabilities."""
    sampled = rng.integers(1, VOCAB, n)
    behavior = -rng.uniform(0.05, 2.5, n)
    raw_lp = behavior + rng.normal(0.0, 0.3, n) if raw else None
    kept = None
    if support:
        kept = []
        for token in sampled:
            others = rng.choice(
                [t for t in range(VOCAB) if t != token], size=int(rng.integers(1, 4)), replace=False
            )
            kept.append(np.concatenate([[token], others]))
    return Call(list(prompt), sampled, behavior, "stop", 0, log_probs=raw_lp, support=kept)


def single_call_sessions(
    seed: int, count: int = 6, *, raw: bool = True, support: bool = False
) -> list[Session]:
    """``count`` one-call sessions over tasks of three samples, prompts of 2-5 ids."""
    rng = np.random.default_rng(seed)
    sessions = []
    for i in range(count):
        prompt = rng.integers(1, VOCAB, int(rng.integers(2, 6)))
        call = draw(rng, prompt, int(rng.integers(1, 5)), raw=raw, support=support)
        sessions.append(
            Session(i // 3, 0, i % 3, 0, [call], "COMPLETED", reward=float(rng.normal()))
        )
    return sessions


def multi_call_sessions(seed: int, *, raw: bool = True) -> list[Session]:
    """Sessions of one to three calls: some calls extend their chain, some start a new one."""
    rng = np.random.default_rng(seed)
    sessions = []
    for i in range(6):
        prompt = list(rng.integers(1, VOCAB, int(rng.integers(2, 4))))
        calls = [draw(rng, prompt, int(rng.integers(1, 4)), raw=raw)]
        for _ in range(int(rng.integers(0, 3))):
            last = calls[-1]
            context = [*last.prompt_ids.tolist(), *last.sampled_ids.tolist()]
            if rng.random() < 0.6 and len(context) + 5 <= WIDTH:
                prompt = context + list(rng.integers(1, VOCAB, 1))  # extends: merges
            else:
                prompt = list(rng.integers(1, VOCAB, int(rng.integers(2, 5))))  # new chain
            calls.append(draw(rng, prompt, int(rng.integers(1, 3)), raw=raw))
        sessions.append(
            Session(i // 3, 0, i % 3, 0, calls, "COMPLETED", reward=float(rng.normal()))
        )
    return sessions


def one_call_per_row(sessions: list[Session], advantages: dict[int, float], width: int) -> dict:
    """Each call alone in its own row (its prompt, then its draw), built without ``pack``.

    ``advantages`` maps a session's index to its advantage. Columns follow pack's layout.
    """
    calls = [(i, k, call) for i, s in enumerate(sessions) for k, call in enumerate(s.calls)]
    rows = len(calls)
    out = {
        "input_ids": np.zeros((rows, width), np.int32),
        "text_segment_ids": np.zeros((rows, width), np.int32),
        "text_positions": np.zeros((rows, width), np.int32),
        "response_mask": np.zeros((rows, width), np.int32),
        "old_log_probs": np.zeros((rows, width), np.float32),
        "behavior_log_probs": np.zeros((rows, width), np.float32),
        "advantages": np.zeros((rows, width), np.float32),
        "session_index": np.full((rows, width), -1, np.int32),
    }
    for r, (i, _, call) in enumerate(calls):
        ids = np.concatenate([call.prompt_ids, call.sampled_ids])
        n, p = ids.size, call.prompt_ids.size
        out["input_ids"][r, :n] = ids
        out["text_segment_ids"][r, :n] = 1
        out["text_positions"][r, :n] = np.arange(n)
        out["response_mask"][r, p:n] = 1
        out["old_log_probs"][r, p:n] = call.old_log_probs
        out["behavior_log_probs"][r, p:n] = call.behavior_log_probs
        out["advantages"][r, :n] = advantages[i]
        out["session_index"][r, p:n] = i
    return out


def one_chain_per_row(batch: dict) -> dict:
    """The chains of a packed batch, each moved alone to column 0 of its own row."""
    segments = batch["text_segment_ids"]
    chains = [(r, s) for r in range(segments.shape[0]) for s in np.unique(segments[r]) if s > 0]
    width = segments.shape[1]
    out = {}
    for name, column in batch.items():
        if column.shape[:2] != segments.shape:
            continue
        fill = -1 if name in ("session_index", "call_index", "versions") else 0
        out[name] = np.full((len(chains), width), fill, column.dtype)
        for j, (r, s) in enumerate(chains):
            where = segments[r] == s
            out[name][j, : where.sum()] = column[r, where]
    out["text_segment_ids"] = (out["text_segment_ids"] > 0).astype(np.int32)
    return out


_APPLY: dict[int, object] = {}


def apply(model, variables, ids, segments):
    """``model.apply`` compiled once per model (the references call it many times)."""
    if id(model) not in _APPLY:
        _APPLY[id(model)] = jax.jit(model.apply)
    return _APPLY[id(model)](variables, jnp.asarray(ids), jnp.asarray(segments))


def chain_log_probs(model, variables, batch: dict, temperature: float = 1.0) -> np.ndarray:
    """NumPy reference of packed_log_probs: every chain scored alone, full vocabulary.

    Returns ``[N, W]`` with each id's log-probability given the ids before it in its chain
    (0 at chain starts and on padding), and the per-prediction logits ``[N, W, V]``.
    """
    alone = one_chain_per_row(batch)
    logits = np.asarray(apply(model, variables, alone["input_ids"], alone["text_segment_ids"]))
    logits = logits.astype(np.float64)
    logits = logits / temperature
    log_probs = logits - np.log(
        np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)
    )
    log_probs -= logits.max(-1, keepdims=True)
    segments = batch["text_segment_ids"]
    out = np.zeros(segments.shape, np.float64)
    full = np.zeros((*segments.shape, logits.shape[-1]), np.float64)
    j = 0
    for r in range(segments.shape[0]):
        for s in np.unique(segments[r]):
            if s == 0:
                continue
            columns = np.flatnonzero(segments[r] == s)
            ids = batch["input_ids"][r, columns]
            for k in range(1, columns.size):
                out[r, columns[k]] = log_probs[j, k - 1, ids[k]]
                full[r, columns[k]] = logits[j, k - 1]
            j += 1
    return out, full


def loss_and_grads(objective, params, batch: dict, ema) -> tuple[float, dict, object]:
    """One jitted value-and-grad of ``objective.loss``: the loss, the metrics as floats and
    the gradients."""
    fn = jax.jit(jax.value_and_grad(objective.loss, has_aux=True))
    (loss, metrics), grad = fn(params, batch, jax.random.key(0), ema)
    return float(loss), {k: float(v) for k, v in metrics.items()}, grad


def assert_same(ours: tuple, theirs: tuple, *, extra: tuple[str, ...] = ()) -> None:
    """Two `loss_and_grads` results agree: the loss (1e-6), every metric of ``theirs``
    (1e-5; ``ours`` has the names in ``extra`` besides) and the gradients (1e-6 absolute,
    1e-5 relative); and the gradient is not all zero, so the comparison means something."""
    (loss_a, metrics_a, grad_a), (loss_b, metrics_b, grad_b) = ours, theirs
    np.testing.assert_allclose(loss_a, loss_b, atol=1e-6, rtol=1e-6)
    assert set(metrics_a) == set(metrics_b) | set(extra), (sorted(metrics_a), sorted(metrics_b))
    for name in metrics_b:
        np.testing.assert_allclose(
            metrics_a[name], metrics_b[name], atol=1e-5, rtol=1e-6, err_msg=name
        )
    for x, y in zip(jax.tree.leaves(grad_a), jax.tree.leaves(grad_b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6, rtol=1e-5)
    assert max(float(jnp.abs(x).max()) for x in jax.tree.leaves(grad_a)) > 1e-3
