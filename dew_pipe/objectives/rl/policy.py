"""The policy side of GRPO (and PPO): options and their composition into one loss.

:class:`PolicyOptions` holds the controls of the spec's GRPO option table and
checks them when built; :func:`policy_loss` turns per-token arrays (current,
old, behavior and reference log-probabilities, advantages and the response
mask) into the scalar loss and its metrics. It is pure and jit-traceable and
knows nothing of models or packing: the objective scores the tokens, this
module decides what to do with the scores.

Two modes, as in verl:

* **decoupled** (``old_log_prob`` given, e.g. the raw likelihoods recorded at
  sampling time or a proximal rescoring): the PPO ratio is current over old;
  ``behavior_importance`` weights each token by old over behavior (a TIS cap,
  or an IcePop band that zeroes out-of-band tokens while they stay in the
  token-mean denominator); the sequence masks reject chains by old versus
  behavior and leave both the policy and the KL term.
* **bypass** (``old_log_prob`` None): behavior stands in for old, so the ratio
  already is current over behavior. The band and the sequence masks compare the
  *detached current* policy with behavior; the band only masks (verl's
  ``token_k1`` rejection with thresholds ``1/high`` and ``1/low``), and masked
  tokens leave the policy term's denominator. A TIS cap is refused, since it
  would apply the same correction twice. The KL term keeps the full response
  mask, because verl's actor reads the batch's mask there and bypass mode only
  changes the mask it hands the policy loss.

The mode is decided per token: ``pack`` writes the behavior likelihood into
``old_log_probs`` where a call recorded no raw one, so a token whose old value
*equals* its behavior value is treated as bypass (the two policies are the same
there, which is exactly verl's bypass premise). A batch from one source is
therefore all decoupled or all bypass, and a mixed batch treats each call by
what it recorded.

Example:
    >>> import jax.numpy as jnp
    >>> opts = PolicyOptions(beta=0.0)
    >>> lp = jnp.full((1, 3), -1.0)
    >>> loss, metrics = policy_loss(
    ...     opts, lp, advantages=jnp.ones((1, 3)), response_mask=jnp.ones((1, 3)),
    ...     behavior_log_prob=lp, old_log_prob=lp)
    >>> float(loss), float(metrics["tokens"])
    (-1.0, 3.0)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from dew_pipe.objectives.rl import losses as L

__all__ = ["POLICY_LOSSES", "PolicyOptions", "policy_loss"]

POLICY_LOSSES = ("ppo", "gspo", "cispo")
_AGGREGATIONS = ("token-mean", "session-mean")


def _band(name: str, value: object) -> tuple[float, float] | None:
    """Check a ``(low, high)`` ratio band with ``0 < low <= high``."""
    if value is None:
        return None
    if (
        not isinstance(value, tuple | list)
        or len(value) != 2
        or any(isinstance(v, bool) or not isinstance(v, int | float) for v in value)
    ):
        raise ValueError(f"{name}: {value!r} is not a (low, high) pair of numbers")
    low, high = float(value[0]), float(value[1])
    if not (0 < low <= high < math.inf):
        raise ValueError(f"{name}: {value!r} needs 0 < low <= high < inf")
    return low, high


@dataclass(frozen=True)
class PolicyOptions:
    """Controls of the clipped policy objective (the spec's GRPO option table).

    Args:
        beta: coefficient of the KL penalty against the frozen reference; 0 turns it
            (and the reference) off.
        epsilon_low: lower clip range of the ratio (verl ``clip_ratio_low``, 0.2).
        epsilon_high: upper clip range (``clip_ratio_high``, 0.2; DAPO uses 0.28).
        dual_clip: PPO's dual-clip bound for negative advantages (> 1; verl's
            ``clip_ratio_c`` = 3.0), or None. Only "ppo" has one; "gspo" and "cispo"
            accept only the default or None.
        policy_loss: "ppo" (dual-clipped token surrogate), "gspo" (clipped sequence
            ratio, pooled per chain) or "cispo" (``-sg(clip(r)) * A * log pi``).
        aggregation: "token-mean" over all trainable tokens, or "session-mean": the mean
            over sessions of each session's token mean (verl "seq-mean-token-mean").
        behavior_importance: None; a cap ``c > 0`` for token TIS weights
            ``min(pi_old / mu, c)``; or an IcePop band ``(low, high)``.
        sequence_mask: ``(low, high)``: reject a chain whose summed k1 (behavior minus
            training log-probability) leaves ``[log low, log high]``.
        geometric_mask: the same with the chain's mean k1.
        kl_estimator: estimator of the reference KL (see :func:`losses.kl_penalty`); "k3".

    Raises:
        ValueError: a value out of range, naming the option.
    """

    beta: float = 0.0
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    dual_clip: float | None = 3.0
    policy_loss: str = "ppo"
    aggregation: str = "token-mean"
    behavior_importance: float | tuple[float, float] | None = None
    sequence_mask: tuple[float, float] | None = None
    geometric_mask: tuple[float, float] | None = None
    kl_estimator: str = "k3"

    def __post_init__(self) -> None:
        for name in ("beta", "epsilon_low", "epsilon_high"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
                raise ValueError(f"{name}: {value!r} is not a finite number >= 0")
            if not math.isfinite(value):
                raise ValueError(f"{name}: {value!r} is not a finite number >= 0")
        if self.epsilon_low >= 1:
            raise ValueError(
                f"epsilon_low: {self.epsilon_low!r} must be below 1 (ratio floor 1 - eps)"
            )
        if self.policy_loss not in POLICY_LOSSES:
            raise ValueError(f"policy_loss: {self.policy_loss!r} is not one of {POLICY_LOSSES}")
        if self.dual_clip is not None:
            if isinstance(self.dual_clip, bool) or not isinstance(self.dual_clip, int | float):
                raise ValueError(f"dual_clip: {self.dual_clip!r} is not a number > 1 or None")
            if not 1 < self.dual_clip < math.inf:
                raise ValueError(
                    f"dual_clip: {self.dual_clip!r} must be > 1 (or None to turn it off)"
                )
            if self.policy_loss != "ppo" and self.dual_clip != 3.0:
                raise ValueError(
                    f"dual_clip: {self.dual_clip!r} has no effect with policy_loss="
                    f"{self.policy_loss!r}; only 'ppo' has a dual clip (pass None)"
                )
        if self.aggregation not in _AGGREGATIONS:
            raise ValueError(f"aggregation: {self.aggregation!r} is not one of {_AGGREGATIONS}")
        importance = self.behavior_importance
        if isinstance(importance, tuple | list):
            object.__setattr__(
                self, "behavior_importance", _band("behavior_importance", importance)
            )
        elif importance is not None:
            if isinstance(importance, bool) or not isinstance(importance, int | float):
                raise ValueError(
                    f"behavior_importance: {importance!r} is not None, a cap > 0 or a (low, high) band"
                )
            if not 0 < importance < math.inf:
                raise ValueError(f"behavior_importance: cap {importance!r} must be > 0 and finite")
            object.__setattr__(self, "behavior_importance", float(importance))
        object.__setattr__(self, "sequence_mask", _band("sequence_mask", self.sequence_mask))
        object.__setattr__(self, "geometric_mask", _band("geometric_mask", self.geometric_mask))
        base = self.kl_estimator.removesuffix("+")
        if base not in L.KL_ESTIMATORS:
            raise ValueError(f"kl_estimator: {self.kl_estimator!r} is not one of {L.KL_ESTIMATORS}")

    @property
    def truncation_cap(self) -> float | None:
        """The TIS cap, or None when behavior_importance is not a cap."""
        value = self.behavior_importance
        return value if isinstance(value, float) else None


def _corrections(
    options: PolicyOptions,
    old_ratio: jax.Array,
    current_ratio: jax.Array,
    stand_in: jax.Array,
    mask: jax.Array,
    chains: jax.Array | None,
) -> tuple[jax.Array | None, jax.Array, jax.Array, dict[str, jax.Array]]:
    """Importance weights, the keep mask, the ESS weights and each mask's removed share.

    ``old_ratio`` is old minus behavior log-probability (0 where behavior stands in),
    ``current_ratio`` the detached current policy minus behavior, and ``stand_in`` marks
    the tokens in bypass mode.
    """
    log_ratio = jnp.where(stand_in, current_ratio, old_ratio)
    raw = jnp.exp(jnp.clip(log_ratio, -L.SAFETY_BOUND, L.SAFETY_BOUND)) * mask
    keep = jnp.ones_like(mask)
    weights, ess, shares = None, raw, {}
    importance = options.behavior_importance
    if isinstance(importance, float):
        # Stand-in tokens have old == behavior, so their weight is min(1, cap).
        weights = L.truncated_importance_weights(old_ratio, mask, importance)
        ess = jnp.clip(weights, 0.0, importance)
    elif importance is not None:
        low, high = importance
        icepop, outside = L.icepop_weights(old_ratio, mask, low, high)
        band = L.band_keep(current_ratio, low, high)
        # Decoupled tokens are weighted (zero out of band, still counted); bypass
        # tokens are masked by the current policy's ratio instead, and leave the count.
        weights = jnp.where(stand_in, mask, icepop)
        keep = jnp.where(stand_in, band, 1.0)
        shares["mask/band"] = L.masked_mean(jnp.where(stand_in, 1.0 - band, outside), mask)
        ess = jnp.clip(jnp.where(stand_in, raw, icepop), 0.0, high)
    for name, bounds, reduce in (
        ("sequence", options.sequence_mask, "sum"),
        ("geometric", options.geometric_mask, "mean"),
    ):
        if bounds is not None:
            kept = L.sequence_keep(log_ratio, mask, bounds[0], bounds[1], chains, reduce=reduce)
            keep = keep * kept
            shares[f"mask/{name}"] = L.masked_mean(1.0 - kept, mask)
    return weights, keep, ess, shares


def _surrogate(
    options: PolicyOptions,
    log_prob: jax.Array,
    old: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    chains: jax.Array | None,
) -> L.PolicyTerms:
    clip = {"epsilon_low": options.epsilon_low, "epsilon_high": options.epsilon_high}
    if options.policy_loss == "ppo":
        return L.ppo_clip_loss(log_prob, old, advantages, dual_clip=options.dual_clip, **clip)
    if options.policy_loss == "gspo":
        return L.gspo_loss(log_prob, old, advantages, mask, chains, **clip)
    return L.cispo_loss(log_prob, old, advantages, **clip)


def policy_loss(
    options: PolicyOptions,
    log_prob: jax.Array,
    *,
    advantages: jax.Array,
    response_mask: jax.Array,
    behavior_log_prob: jax.Array,
    old_log_prob: jax.Array | None = None,
    ref_log_prob: jax.Array | None = None,
    chains: jax.Array | None = None,
    sessions: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The GRPO loss of per-token arrays, and its metrics.

    Args:
        options: the controls.
        log_prob: current policy log-probabilities of the sampled ids (differentiated).
        advantages: per-token advantages (not differentiated).
        response_mask: 1 on trainable sampled ids.
        behavior_log_prob: what the engine's sampler reported for each id.
        old_log_prob: the policy the ratio is taken against; None selects bypass mode.
        ref_log_prob: frozen reference log-probabilities; required when ``beta > 0``.
        chains: chain id of each token (GSPO pooling, sequence masks); None: rows.
        sessions: session id of each token ("session-mean"); None: rows.

    Returns:
        ``(loss, metrics)``: ``pg_loss``, ``kl_loss`` (beta > 0), ``pg_clipfrac``,
        ``pg_clipfrac_lower``, ``ppo_kl``, ``tokens`` (trainable tokens after the
        masks), ``loss_weight`` (what the policy term averages over: ``tokens`` under
        "token-mean", sessions with a trainable token under "session-mean"),
        ``mismatch/kl``, ``mismatch/k3_kl``, ``mismatch/ess``, and ``mask/band``,
        ``mask/sequence``, ``mask/geometric`` for the masks in use.

    Raises:
        ValueError: a TIS cap in bypass mode, or ``beta > 0`` without ``ref_log_prob``.
    """
    mask = response_mask.astype(log_prob.dtype)
    behavior = jax.lax.stop_gradient(behavior_log_prob.astype(log_prob.dtype))
    advantages = jax.lax.stop_gradient(advantages.astype(log_prob.dtype))
    if old_log_prob is None:
        if options.truncation_cap is not None:
            raise ValueError(
                f"behavior_importance: a TIS cap ({options.truncation_cap}) needs old_log_probs; "
                "without them the ratio already is current over behavior and the cap would "
                "correct twice (use a (low, high) band or record old_log_probs)"
            )
        old = behavior
    else:
        old = jax.lax.stop_gradient(old_log_prob.astype(log_prob.dtype))
    # Where old equals behavior, behavior stands in for a recorded old policy: bypass mode.
    stand_in = old == behavior
    current_ratio = jax.lax.stop_gradient(log_prob) - behavior
    old_ratio = jnp.where(stand_in, 0.0, old - behavior)
    weights, keep, ess, metrics = _corrections(
        options, old_ratio, current_ratio, stand_in, mask, chains
    )
    effective = mask * keep
    train = jnp.where(stand_in, jax.lax.stop_gradient(log_prob), old)
    mismatch = L.mismatch_metrics(train, behavior, mask, weights=ess)
    metrics.update({f"mismatch/{k}": v for k, v in mismatch.items()})

    terms = _surrogate(options, log_prob, old, advantages, effective, chains)
    token_loss = terms.loss if weights is None else terms.loss * weights
    mode = "token-mean" if options.aggregation == "token-mean" else "seq-mean-token-mean"
    groups = sessions if options.aggregation == "session-mean" else None
    pg = L.aggregate(token_loss, effective, mode, groups)
    metrics["pg_loss"] = pg
    metrics["pg_clipfrac"] = L.masked_mean(terms.clipped, effective)
    metrics["pg_clipfrac_lower"] = L.masked_mean(terms.clipped_lower, effective)
    metrics["ppo_kl"] = jax.lax.stop_gradient(L.masked_mean(-terms.log_ratio, effective))
    metrics["tokens"] = jnp.sum(effective)
    # What the policy term averages over; gradient accumulation weights microbatches by it
    # so that k microbatches add up to the gradient of their concatenation (exact when the
    # sessions are not split across microbatches and the KL term counts the same ones).
    if options.aggregation == "token-mean":
        metrics["loss_weight"] = metrics["tokens"]
    else:
        metrics["loss_weight"] = L.groups_present(effective, groups)
    total = pg
    if options.beta > 0:
        if ref_log_prob is None:
            raise ValueError("ref_log_prob: beta > 0 needs the reference log-probabilities")
        ref = jax.lax.stop_gradient(ref_log_prob.astype(log_prob.dtype))
        kl = L.aggregate(
            L.kl_penalty(log_prob, ref, options.kl_estimator),
            jnp.where(stand_in, mask, effective),
            mode,
            groups,
        )
        metrics["kl_loss"] = kl
        total = pg + options.beta * kl
    return total, {k: jax.lax.stop_gradient(v) for k, v in metrics.items()}
