"""Outcome advantage estimators: one scalar reward per session, one advantage per session.

Each estimator is a pure function of a reward vector and a vector of group ids (any values
that sort, one per reward). Rewards are compared only with the rewards of the same group.

======== =============================================== =====================================
name     advantage of reward r in a group of n rewards   reference
======== =============================================== =====================================
"group"  (r - mean) / (std + epsilon), std unbiased      verl compute_grpo_outcome_advantage
"mean"   r - mean                                        same, norm_adv_by_std_in_grpo=False
"rloo"   r - mean of the other n - 1 rewards             verl compute_rloo_outcome_advantage
"reward" r itself (no baseline)                          PPO: GAE over the critic replaces it
======== =============================================== =====================================

"reward" exists for PPO's pipeline view: ``pack(..., estimator="reward")`` lays each
session's reward on its ids, where the values stage (``dew_pipe.stages.Values``) reads it
and writes GAE advantages in its place.

A group of one reward has nothing to compare with; like verl, its mean counts as 0 and its
standard deviation as 1, so "group" gives r / (1 + epsilon) and "mean" and "rloo" give r.
A group whose rewards are all equal gets advantage 0 under every estimator.

The arithmetic is done in float64 and the result returned as float32, the dtype of the
``advantages`` column of a packed batch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

__all__ = [
    "ESTIMATORS",
    "compute_advantages",
    "group_advantages",
    "mean_advantages",
    "reward_advantages",
    "rloo_advantages",
]

GRPO_EPSILON = 1e-6
"""verl's default epsilon in the GRPO denominator."""


def _grouped(rewards: Any, groups: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Validate inputs; return rewards (float64), group number per reward, counts, means.

    A group of one has mean 0 (verl's convention).
    """
    r = np.asarray(rewards)
    if r.dtype == np.bool_ or not (np.issubdtype(r.dtype, np.number) or r.size == 0):
        raise TypeError(f"rewards: expected real numbers, got dtype {r.dtype}")
    r = r.astype(np.float64)
    if r.ndim != 1:
        raise ValueError(f"rewards: expected a 1-D array, got shape {r.shape}")
    if not np.all(np.isfinite(r)):
        bad = int(np.flatnonzero(~np.isfinite(r))[0])
        raise ValueError(f"rewards: expected finite values, got {r[bad]} at index {bad}")
    g = np.asarray(groups)
    if g.shape != r.shape:
        raise ValueError(f"groups: expected shape {r.shape} (one id per reward), got {g.shape}")
    if r.size == 0:
        empty = np.zeros(0, np.int64)
        return r, empty, empty, np.zeros(0, np.float64)
    _, inverse = np.unique(g, return_inverse=True)
    inverse = inverse.reshape(-1)
    counts = np.bincount(inverse)
    means = np.bincount(inverse, weights=r) / counts
    means[counts == 1] = 0.0
    return r, inverse, counts, means


def group_advantages(rewards: Any, groups: Any, *, epsilon: float = GRPO_EPSILON) -> np.ndarray:
    """GRPO advantages: rewards standardized within their group.

    Args:
        rewards: ``[n]`` finite rewards.
        groups: ``[n]`` group ids; rewards with equal ids form a group.
        epsilon: added to the (unbiased) group standard deviation before dividing.

    Returns:
        ``[n]`` float32 advantages.

    Raises:
        TypeError: rewards are not real numbers.
        ValueError: shapes differ or a reward is not finite.

    Example:
        >>> group_advantages([1.0, 0.0, 0.0, 1.0], [0, 0, 1, 1]).astype(float).round(4).tolist()
        [0.7071, -0.7071, -0.7071, 0.7071]
    """
    r, inverse, counts, means = _grouped(rewards, groups)
    centred = r - means[inverse]
    squares = np.bincount(inverse, weights=centred**2, minlength=counts.size)
    std = np.ones(counts.size, np.float64)
    many = counts > 1
    std[many] = np.sqrt(squares[many] / (counts[many] - 1))
    return (centred / (std[inverse] + epsilon)).astype(np.float32)


def mean_advantages(rewards: Any, groups: Any) -> np.ndarray:
    """Dr.GRPO advantages: rewards minus their group mean, not rescaled.

    Args:
        rewards: ``[n]`` finite rewards.
        groups: ``[n]`` group ids.

    Returns:
        ``[n]`` float32 advantages.

    Raises:
        TypeError, ValueError: as :func:`group_advantages`.

    Example:
        >>> mean_advantages([3.0, 1.0, 5.0], [0, 0, 1]).tolist()
        [1.0, -1.0, 5.0]
    """
    r, inverse, _, means = _grouped(rewards, groups)
    return (r - means[inverse]).astype(np.float32)


def rloo_advantages(rewards: Any, groups: Any) -> np.ndarray:
    """Leave-one-out advantages: each reward minus the mean of the others in its group.

    Args:
        rewards: ``[n]`` finite rewards.
        groups: ``[n]`` group ids.

    Returns:
        ``[n]`` float32 advantages; a group of one keeps its reward.

    Raises:
        TypeError, ValueError: as :func:`group_advantages`.

    Example:
        >>> rloo_advantages([3.0, 1.0, 2.0], [0, 0, 0]).tolist()
        [1.5, -1.5, 0.0]
    """
    r, inverse, counts, means = _grouped(rewards, groups)
    n = counts[inverse].astype(np.float64)
    # n / (n - 1) * (r - mean) == r - (sum - r) / (n - 1); a singleton keeps r (mean is 0).
    scale = np.where(n > 1, n / np.maximum(n - 1, 1), 1.0)
    return (scale * (r - means[inverse])).astype(np.float32)


def reward_advantages(rewards: Any, groups: Any) -> np.ndarray:
    """The rewards themselves, compared with nothing (for PPO, whose GAE replaces them).

    Args:
        rewards: ``[n]`` finite rewards.
        groups: ``[n]`` group ids (checked, not used).

    Returns:
        ``[n]`` float32 rewards.

    Raises:
        TypeError, ValueError: as :func:`group_advantages`.

    Example:
        >>> reward_advantages([3.0, 1.0], [0, 0]).tolist()
        [3.0, 1.0]
    """
    return _grouped(rewards, groups)[0].astype(np.float32)


ESTIMATORS: Mapping[str, Callable[[Any, Any], np.ndarray]] = {
    "group": group_advantages,
    "mean": mean_advantages,
    "rloo": rloo_advantages,
    "reward": reward_advantages,
}
"""The estimators ``pack`` and ``SampledRollout`` accept, by name."""


def compute_advantages(rewards: Any, groups: Any, estimator: str = "group") -> np.ndarray:
    """Advantages of ``rewards`` within ``groups`` by the named estimator.

    Args:
        rewards: ``[n]`` finite rewards.
        groups: ``[n]`` group ids.
        estimator: ``"group"``, ``"mean"``, ``"rloo"`` or ``"reward"``.

    Returns:
        ``[n]`` float32 advantages.

    Raises:
        ValueError: unknown estimator, or bad rewards/groups.

    Example:
        >>> compute_advantages([1.0, 0.0], [7, 7], "mean").tolist()
        [0.5, -0.5]
    """
    try:
        fn = ESTIMATORS[estimator]
    except (KeyError, TypeError):
        raise ValueError(
            f"estimator: expected one of {sorted(ESTIMATORS)}, got {estimator!r}"
        ) from None
    return fn(rewards, groups)
