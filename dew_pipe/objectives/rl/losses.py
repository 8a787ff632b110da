"""Pure token-level pieces of the GRPO/PPO policy objective.

Every function here takes and returns plain ``jax.Array`` values shaped like the
per-token arrays of a batch (``[N, W]`` for packed rows, ``[B, T]`` for verl's
response tensors) and is safe to trace under ``jit`` and ``grad``. The
objective in :mod:`dew_pipe.objectives.rl.grpo` composes them; PPO reuses them.

The numbers follow verl 0.9.1 (``verl.trainer.ppo.core_algos`` and
``verl.trainer.ppo.rollout_corr_helper``): the same clamps (log-ratios to
[-20, 20] before exponentiating, k3 to [-10, 10], GSPO's log-ratio to at most
10), the same masked means (``sum / (count + 1e-8)``) and the same reductions.
``tests/parity/record_verl.py`` records verl's outputs and gradients on fixed
tensors and ``tests/test_grpo_losses.py`` compares them at 1e-6.

Groups: where verl reduces over a row of its ``[B, T]`` response tensor, these
functions reduce over a *group* of tokens named by an integer array of the same
shape (``groups``). ``None`` means "each row along the last axis is one group",
which is verl's layout. Packed rows pass chain ids (:func:`chain_ids`) or
session ids instead, so several chains can share a row.

Example:
    >>> import jax.numpy as jnp
    >>> lp = jnp.log(jnp.array([[0.5, 0.25]]))
    >>> terms = ppo_clip_loss(lp, lp, jnp.array([[1.0, -1.0]]))
    >>> float(aggregate(terms.loss, jnp.ones((1, 2))))
    0.0
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = [
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "SAFETY_BOUND",
    "PolicyTerms",
    "aggregate",
    "band_keep",
    "chain_ids",
    "cispo_loss",
    "groups_present",
    "gspo_loss",
    "icepop_weights",
    "kl_penalty",
    "masked_mean",
    "mismatch_metrics",
    "ppo_clip_loss",
    "sequence_keep",
    "truncated_importance_weights",
]

SAFETY_BOUND = 20.0
"""Log-ratios are clamped to [-20, 20] before ``exp`` (exp(20) is about 4.9e8)."""

AGGREGATIONS = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "seq-mean-token-mean",
    "session-mean",
)
"""Reductions of a per-token loss; "session-mean" is "seq-mean-token-mean" over sessions."""

KL_ESTIMATORS = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")
"""Estimators :func:`kl_penalty` accepts; each may end in "+" (straight-through k2 gradient)."""


class PolicyTerms(NamedTuple):
    """Per-token output of a policy surrogate, before weights and aggregation.

    Attributes:
        loss: the surrogate loss of each token (to be minimised).
        clipped: 1.0 where the ratio clip was active (verl's ``pg_clipfrac`` numerator).
        clipped_lower: 1.0 where PPO's dual clip bound the loss of a negative advantage.
        log_ratio: ``log_prob - old_log_prob`` as verl's ``ppo_kl`` metric reads it.
    """

    loss: jax.Array
    clipped: jax.Array
    clipped_lower: jax.Array
    log_ratio: jax.Array


def masked_sum(values: jax.Array, mask: jax.Array, axis: int | None = None) -> jax.Array:
    """Sum of ``values`` where ``mask`` is nonzero (values elsewhere never leak, even NaN)."""
    return jnp.sum(jnp.where(mask != 0, values * mask, 0.0), axis=axis)


def masked_mean(values: jax.Array, mask: jax.Array, axis: int | None = None) -> jax.Array:
    """verl's masked mean, ``sum(values * mask) / (sum(mask) + 1e-8)``; 0 for an empty mask."""
    return masked_sum(values, mask, axis) / (jnp.sum(mask, axis=axis) + 1e-8)


def chain_ids(segment_ids: jax.Array) -> jax.Array:
    """Batch-unique id of each token's chain in packed rows ``[N, W]``.

    Tokens of segment ``s`` in row ``n`` get ``n * W + s``; padding (segment 0) gets
    its row's id ``n * W``, which no chain uses, so it never pools with a chain.

    Args:
        segment_ids: int array ``[N, W]`` with values in ``[0, W)``.

    Returns:
        int32 array ``[N, W]``.
    """
    rows, width = segment_ids.shape
    return (jnp.arange(rows, dtype=jnp.int32)[:, None] * width + segment_ids).astype(jnp.int32)


def _dense_groups(values: jax.Array, groups: jax.Array | None) -> tuple[jax.Array, int]:
    """Map group ids to ``0 .. G-1`` (flattened); rows along the last axis when None."""
    if groups is None:
        rows = values.size // values.shape[-1]
        ids = jnp.broadcast_to(
            jnp.arange(rows, dtype=jnp.int32).reshape(values.shape[:-1] + (1,)), values.shape
        )
        return ids.reshape(-1), rows
    if groups.shape != values.shape:
        raise ValueError(f"groups: shape {groups.shape} differs from the values' {values.shape}")
    flat = groups.reshape(-1)
    # A sort, but jit-friendly with a static size: every token could be its own group.
    _, inverse = jnp.unique(flat, return_inverse=True, size=flat.size)
    return inverse.reshape(-1), flat.size


def _group_sums(values: jax.Array, groups: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """Per-group sums of ``values`` and the dense group id of every token (flattened)."""
    ids, count = _dense_groups(values, groups)
    return jax.ops.segment_sum(values.reshape(-1), ids, num_segments=count), ids


def _per_token_group_sum(values: jax.Array, groups: jax.Array | None) -> jax.Array:
    """Sum of ``values`` over each token's group, broadcast back to the token."""
    sums, ids = _group_sums(values, groups)
    return sums[ids].reshape(values.shape)


def groups_present(mask: jax.Array, groups: jax.Array | None = None) -> jax.Array:
    """How many groups hold at least one masked-in token (float32 scalar).

    The divisor of the "seq-mean-*" reductions of :func:`aggregate`, before its floor of 1.

    Example:
        >>> float(groups_present(jnp.array([[1, 0, 1, 0]]), jnp.array([[3, 3, 5, 7]])))
        2.0
    """
    counts, _ = _group_sums(mask.astype(jnp.float32), groups)
    return jnp.sum(counts > 0, dtype=jnp.float32)


def aggregate(
    loss: jax.Array,
    mask: jax.Array,
    mode: str = "token-mean",
    groups: jax.Array | None = None,
    horizon: float | None = None,
) -> jax.Array:
    """Reduce a per-token loss to a scalar, as verl's ``agg_loss`` on one device.

    Args:
        loss: per-token loss.
        mask: 1.0 on tokens that count, 0.0 elsewhere (same shape).
        mode: one of :data:`AGGREGATIONS`. "token-mean" divides the masked sum by the
            token count; "seq-mean-token-mean" (alias "session-mean") averages each
            group's token mean over the groups that have a token; "seq-mean-token-sum"
            averages group sums; "-norm" further divides by ``horizon``.
        groups: group id of every token (see the module docstring); None: rows.
        horizon: divisor of "seq-mean-token-sum-norm"; default ``loss.shape[-1]``.

    Returns:
        Scalar. An empty mask gives 0 (verl would divide by zero).

    Raises:
        ValueError: unknown ``mode``.
    """
    mask = mask.astype(loss.dtype)
    if mode == "token-mean":
        return masked_sum(loss, mask) / jnp.maximum(jnp.sum(mask), 1.0)
    if mode == "token-sum":
        return masked_sum(loss, mask)
    if mode not in AGGREGATIONS:
        raise ValueError(f"aggregation: {mode!r} is not one of {AGGREGATIONS}")
    sums, _ = _group_sums(jnp.where(mask != 0, loss * mask, 0.0), groups)
    counts, _ = _group_sums(mask, groups)
    present = (counts > 0).astype(loss.dtype)
    sequences = jnp.maximum(jnp.sum(present), 1.0)
    if mode in ("seq-mean-token-mean", "session-mean"):
        return jnp.sum(sums / (counts + 1e-8) * present) / sequences
    total = jnp.sum(sums * present) / sequences
    if mode == "seq-mean-token-sum-norm":
        total = total / (loss.shape[-1] if horizon is None else horizon)
    return total


def ppo_clip_loss(
    log_prob: jax.Array,
    old_log_prob: jax.Array,
    advantages: jax.Array,
    *,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    dual_clip: float | None = 3.0,
) -> PolicyTerms:
    """Clipped PPO surrogate with the dual clip (verl ``compute_policy_loss_vanilla``).

    ``r = exp(clip(log_prob - old, -20, 20))``; the token loss is
    ``max(-A r, -A clip(r, 1 - epsilon_low, 1 + epsilon_high))``, and for ``A < 0``
    it is further bounded by ``-A * dual_clip`` (Ye et al. 2019).

    Args:
        log_prob: current log-probabilities (differentiated).
        old_log_prob: log-probabilities of the policy the ratio is taken against.
        advantages: per-token advantages.
        epsilon_low: lower clip range.
        epsilon_high: upper clip range (DAPO's clip-higher when larger).
        dual_clip: bound on the ratio's effect for negative advantages (> 1), or None.

    Returns:
        :class:`PolicyTerms`.
    """
    log_ratio = jnp.clip(log_prob - old_log_prob, -SAFETY_BOUND, SAFETY_BOUND)
    ratio = jnp.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * jnp.clip(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
    loss = jnp.maximum(unclipped, clipped)
    clipfrac = (clipped > unclipped).astype(log_prob.dtype)
    if dual_clip is None:
        return PolicyTerms(loss, clipfrac, jnp.zeros_like(loss), log_ratio)
    bound = -advantages * dual_clip
    negative = advantages < 0
    lower = ((loss > bound) & negative).astype(log_prob.dtype)
    loss = jnp.where(negative, jnp.minimum(bound, loss), loss)
    return PolicyTerms(loss, clipfrac, lower, log_ratio)


def gspo_loss(
    log_prob: jax.Array,
    old_log_prob: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    groups: jax.Array | None = None,
    *,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
) -> PolicyTerms:
    """Sequence-ratio surrogate of GSPO (verl ``compute_policy_loss_gspo``).

    Each group's (chain's) ratio is the exponentiated mean log-ratio over its masked
    tokens, carried per token as ``sg(s) * pi / sg(pi)`` so every token gets its own
    gradient; the log is capped at 10, and the loss is the clipped surrogate with no
    dual clip.

    Args:
        log_prob, old_log_prob, advantages: per-token arrays.
        mask: tokens that belong to a sequence's mean.
        groups: sequence id of each token (None: rows), e.g. :func:`chain_ids`.
        epsilon_low, epsilon_high: clip range of the sequence ratio.

    Returns:
        :class:`PolicyTerms` (``clipped_lower`` is all zeros).
    """
    mask = mask.astype(log_prob.dtype)
    log_ratio = log_prob - old_log_prob
    total = _per_token_group_sum(jnp.where(mask != 0, log_ratio * mask, 0.0), groups)
    length = jnp.maximum(_per_token_group_sum(mask, groups), 1.0)
    sequence = jax.lax.stop_gradient(total / length)
    log_seq = log_prob - jax.lax.stop_gradient(log_prob) + sequence
    ratio = jnp.exp(jnp.minimum(log_seq, 10.0))
    unclipped = -advantages * ratio
    clipped = -advantages * jnp.clip(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
    loss = jnp.maximum(unclipped, clipped)
    clipfrac = (clipped > unclipped).astype(log_prob.dtype)
    return PolicyTerms(loss, clipfrac, jnp.zeros_like(loss), log_ratio)


def cispo_loss(
    log_prob: jax.Array,
    old_log_prob: jax.Array,
    advantages: jax.Array,
    *,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
) -> PolicyTerms:
    """CISPO: ``-sg(clip(r)) * A * log_prob`` (verl ``compute_policy_loss_cispo``).

    The clipped ratio only weights the REINFORCE term, so clipped tokens still pass a
    gradient (MiniMax-M1).

    Returns:
        :class:`PolicyTerms` (``clipped`` marks ``clip(r) != r``).
    """
    log_ratio = jnp.clip(log_prob - old_log_prob, -SAFETY_BOUND, SAFETY_BOUND)
    ratio = jnp.exp(log_ratio)
    bounded = jnp.clip(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
    loss = -jax.lax.stop_gradient(bounded) * advantages * log_prob
    clipfrac = (ratio != bounded).astype(log_prob.dtype)
    return PolicyTerms(loss, clipfrac, jnp.zeros_like(loss), log_ratio)


def kl_penalty(log_prob: jax.Array, ref_log_prob: jax.Array, kind: str = "k3") -> jax.Array:
    """Per-token KL estimate between the policy and a reference (verl ``kl_penalty``).

    Args:
        log_prob: policy log-probabilities of the sampled ids (differentiated).
        ref_log_prob: reference log-probabilities of the same ids.
        kind: "k1"/"kl" (``lp - ref``), "abs", "k2"/"mse" (half squared), or
            "k3"/"low_var_kl" (``exp(ref - lp) - (ref - lp) - 1`` with the inner
            difference clamped to [-20, 20] and the result to [-10, 10]). A trailing
            "+" keeps the value but takes the gradient of k2 (straight-through).

    Returns:
        Per-token estimate, same shape.

    Raises:
        ValueError: unknown ``kind``.
    """
    base = kind[:-1] if kind.endswith("+") else kind
    diff = log_prob - ref_log_prob
    if base in ("k1", "kl"):
        value = diff
    elif base == "abs":
        value = jnp.abs(diff)
    elif base in ("k2", "mse"):
        value = 0.5 * jnp.square(diff)
    elif base in ("k3", "low_var_kl"):
        inner = jnp.clip(-diff, -SAFETY_BOUND, SAFETY_BOUND)
        value = jnp.clip(jnp.exp(inner) - inner - 1.0, -10.0, 10.0)
    else:
        raise ValueError(
            f"kl estimator: {kind!r} is not one of {KL_ESTIMATORS} (optionally with '+')"
        )
    if not kind.endswith("+") or base in ("k2", "mse"):
        return value
    straight = 0.5 * jnp.square(diff)
    return straight - jax.lax.stop_gradient(straight) + jax.lax.stop_gradient(value)


def truncated_importance_weights(log_ratio: jax.Array, mask: jax.Array, cap: float) -> jax.Array:
    """Token TIS weights ``min(exp(clip(log_ratio, -20, 20)), cap)``, zero off the mask.

    ``log_ratio`` is proximal (or old) minus behavior log-probability; the weights are
    detached (verl ``compute_rollout_correction_weights`` with a float threshold).
    """
    raw = jnp.exp(jnp.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)) * mask
    return jax.lax.stop_gradient(jnp.minimum(raw, cap))


def icepop_weights(
    log_ratio: jax.Array, mask: jax.Array, low: float, high: float
) -> tuple[jax.Array, jax.Array]:
    """IcePop band: the raw token ratio inside ``[low, high]``, zero outside.

    verl ``compute_rollout_correction_weights`` with a ``"low_high"`` threshold.

    Returns:
        ``(weights, outside)``: detached weights and 1.0 on masked tokens outside the band.
    """
    raw = jnp.exp(jnp.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)) * mask
    inside = (raw >= low) & (raw <= high)
    weights = jax.lax.stop_gradient(jnp.where(inside, raw, 0.0))
    return weights, (~inside).astype(raw.dtype) * mask


def band_keep(log_ratio: jax.Array, low: float, high: float) -> jax.Array:
    """Tokens whose ratio lies in ``[low, high]``, tested as verl's ``token_k1`` rejection.

    verl's k1 statistic is ``-clip(log_ratio, -20, 20)``; the band ``[low, high]`` on the
    ratio is its ``[log(1/high), log(1/low)]``, which is how bypass mode applies IcePop.

    Returns:
        1.0 where kept, 0.0 where rejected (unmasked).
    """
    k1 = -jnp.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)
    lower, upper = jnp.log(1.0 / high), jnp.log(1.0 / low)
    return ((k1 >= lower) & (k1 <= upper)).astype(log_ratio.dtype)


def sequence_keep(
    log_ratio: jax.Array,
    mask: jax.Array,
    low: float,
    high: float,
    groups: jax.Array | None = None,
    *,
    reduce: str = "sum",
) -> jax.Array:
    """Rejection of whole sequences by their k1 divergence from the behavior policy.

    k1 per token is ``-clip(log_ratio, -20, 20)`` (behavior minus training log-prob); a
    sequence is kept when the sum ("sum", verl ``seq_sum_k1``) or the masked mean
    ("mean", ``seq_mean_k1``) of its k1 lies in ``[log low, log high]``.

    Args:
        log_ratio: training (proximal or current) minus behavior log-probability.
        mask: tokens of each sequence.
        low, high: bounds of the band, ``0 < low <= high``.
        groups: sequence id of each token (None: rows).
        reduce: "sum" or "mean".

    Returns:
        1.0 on tokens of kept sequences, 0.0 on tokens of rejected ones (unmasked).

    Raises:
        ValueError: unknown ``reduce``.
    """
    if reduce not in ("sum", "mean"):
        raise ValueError(f"reduce: {reduce!r} is not 'sum' or 'mean'")
    mask = mask.astype(log_ratio.dtype)
    k1 = -jnp.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)
    stat = _per_token_group_sum(jnp.where(mask != 0, k1 * mask, 0.0), groups)
    if reduce == "mean":
        stat = stat / (_per_token_group_sum(mask, groups) + 1e-8)
    keep = (stat >= jnp.log(low)) & (stat <= jnp.log(high))
    return keep.astype(log_ratio.dtype)


def mismatch_metrics(
    train_log_prob: jax.Array,
    behavior_log_prob: jax.Array,
    mask: jax.Array,
    weights: jax.Array | None = None,
    cap: float | None = None,
) -> dict[str, jax.Array]:
    """Trainer/engine mismatch over the masked tokens (verl's off-policy diagnostics).

    Args:
        train_log_prob: the training side (old/proximal, or the detached current policy).
        behavior_log_prob: what the engine reported when it sampled.
        mask: tokens to average over.
        weights: the importance weights applied, if any; None uses the raw ratios.
        cap: upper clamp of the weights before the effective sample size (verl clamps to
            its threshold); None: no clamp.

    Returns:
        ``kl``: mean of ``behavior - train``; ``k3_kl``: mean of ``r - log r - 1`` with
        ``log r = train - behavior`` (unclamped); ``ess``: ``1 / mean((w / mean w)^2)``,
        1.0 when all weights are equal.
    """
    mask = mask.astype(train_log_prob.dtype)
    log_ratio = train_log_prob - behavior_log_prob
    kl = masked_mean(behavior_log_prob - train_log_prob, mask)
    k3 = masked_mean(jnp.exp(log_ratio) - log_ratio - 1.0, mask)
    if weights is None:
        weights = jnp.exp(jnp.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)) * mask
    if cap is not None:
        weights = jnp.clip(weights, 0.0, cap)
    normalized = weights / (masked_mean(weights, mask) + 1e-8)
    ess = 1.0 / masked_mean(jnp.square(normalized), mask)
    return {"kl": kl, "k3_kl": k3, "ess": jax.lax.stop_gradient(ess)}
