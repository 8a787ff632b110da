"""Generalized advantage estimation over whole episodes laid out in packed rows.

An episode's sampled ids (its actions, EOS included) may sit in several chains and rows of
a packed batch: a tool turn whose context re-renders history starts a new chain, and chains
are packed first-fit. :func:`episode_gae` puts them back in draw order (by session, then
call, then column) and runs GAE over that one sequence per episode, as verl's
``compute_gae_advantage_return`` runs it over one multi-turn response whose observation
ids are masked: observations never get a value, a TD error or an advantage, and the next
action's value bootstraps the one before it across the tool turn.

Per action id ``t`` of an episode of ``T`` ids, with critic values ``v_t``::

    delta_t = r_t + gamma * v_{t+1} - v_t          (v_T = 0: a completed episode ends)
    A_t     = delta_t + gamma * lam * A_{t+1}      (A_T = 0)
    R_t     = A_t + v_t                             (the value target, "returns")

where ``r_t`` is 0 except on the episode's last id, which carries the verifier's reward.
The advantages are then whitened over every action id of the batch (verl's
``masked_whiten``: mean 0, unbiased variance 1 up to its epsilon of 1e-8); the returns are
not. The arithmetic is float32 in verl's order of operations, so the result matches verl's
to rounding (``tests/test_ppo.py`` checks it against the recorded reference).

Only sessions with trainable ids take part: ``pack`` gives truncated episodes no rows
(``truncation="mask"``), so they are neither bootstrapped nor part of the whitening.

Example:
    >>> import numpy as np
    >>> mask = np.array([[0, 1, 1, 0, 1]])        # one chain: prompt, 2 ids, an observation, 1 id
    >>> batch = {"response_mask": mask, "session_index": np.zeros_like(mask),
    ...          "call_index": np.array([[0, 0, 0, 0, 1]])}
    >>> values = np.array([[0.0, 0.5, 0.25, 9.0, 0.5]], np.float32)   # 9.0: never read
    >>> rewards = np.where(mask == 1, 1.0, 0.0).astype(np.float32)
    >>> adv, ret = episode_gae(batch, values, rewards, gamma=1.0, lam=1.0, whiten=False)
    >>> ret[0].tolist()                           # undiscounted: every action returns 1
    [0.0, 1.0, 1.0, 0.0, 1.0]
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["WHITEN_EPSILON", "episode_gae", "whiten"]

WHITEN_EPSILON = 1e-8
"""verl's epsilon under the square root of the variance (and in its masked means)."""


def _draw_order(batch: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows, columns and sessions of the trainable ids, sorted into draw order."""
    mask = np.asarray(batch["response_mask"])
    rows, cols = np.nonzero(mask == 1)
    sessions = np.asarray(batch["session_index"])[rows, cols]
    calls = np.asarray(batch["call_index"])[rows, cols]
    if sessions.size and sessions.min() < 0:
        r, c = rows[np.argmin(sessions)], cols[np.argmin(sessions)]
        raise ValueError(
            f"batch field 'session_index' is {int(sessions.min())} at row {r}, column {c}, "
            "a trainable id; expected the session it was sampled in (>= 0)"
        )
    order = np.lexsort((cols, rows, calls, sessions))
    return rows[order], cols[order], sessions[order]


def whiten(values: np.ndarray) -> np.ndarray:
    """verl's ``masked_whiten`` of a flat float32 array (every entry counts).

    float32 in verl's order of operations (mean, centring, biased variance, Bessel's
    factor, ``rsqrt(var + 1e-8)``); each sum is the correctly rounded float32 of the exact
    sum, which torch's own float32 reductions reach or miss by an ulp.

    Raises:
        ValueError: fewer than two entries (the unbiased variance is undefined).

    Example:
        >>> whiten(np.array([1.0, 3.0], np.float32)).astype(float).round(4).tolist()
        [-0.7071, 0.7071]
    """
    n = values.size
    if n < 2:
        raise ValueError(
            f"whitening needs at least two trainable action ids; got {n} (the unbiased "
            "variance of one value is undefined)"
        )
    values = np.asarray(values, np.float32)
    count = np.float32(n)
    denominator = count + np.float32(WHITEN_EPSILON)
    mean = np.float32(values.sum(dtype=np.float64)) / denominator
    centred = values - mean
    variance = np.float32(np.square(centred).sum(dtype=np.float64)) / denominator
    variance = variance * (count / (count - np.float32(1)))
    scale = np.float32(1) / np.sqrt(variance + np.float32(WHITEN_EPSILON))
    return (centred * scale).astype(np.float32)


def episode_gae(
    batch: Mapping[str, Any],
    values: np.ndarray,
    rewards: np.ndarray,
    *,
    gamma: float,
    lam: float,
    whiten: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """GAE advantages and returns of every episode in a packed batch.

    Args:
        batch: packed rows with ``response_mask``, ``session_index`` and ``call_index``
            (``[N, W]``); one session is one episode.
        values: ``[N, W]`` the critic's value before each id (``packed_values``); read only
            on trainable ids.
        rewards: ``[N, W]`` each trainable id's episode reward (the same on every id of an
            episode, as ``pack(..., estimator="reward")`` writes it into ``advantages``);
            it is paid on the episode's last id.
        gamma: discount per action id, in ``[0, 1]``.
        lam: GAE's lambda, in ``[0, 1]``.
        whiten: whiten the advantages over all trainable ids (verl does).

    Returns:
        ``(advantages, returns)``, both ``[N, W]`` float32, 0 off the trainable ids. A
        batch without trainable ids gives zeros.

    Raises:
        ValueError: shapes that differ from ``response_mask``'s; an episode whose ids
            carry different rewards; non-finite values or rewards on trainable ids; exactly
            one trainable id when whitening.
    """
    mask = np.asarray(batch["response_mask"])
    values, rewards = np.asarray(values), np.asarray(rewards)
    for name, array in (("values", values), ("rewards", rewards)):
        if array.shape != mask.shape:
            raise ValueError(
                f"{name} has shape {array.shape}; expected response_mask's {mask.shape}"
            )
    advantages = np.zeros(mask.shape, np.float32)
    returns = np.zeros(mask.shape, np.float32)
    rows, cols, sessions = _draw_order(batch)
    if rows.size == 0:
        return advantages, returns
    flat_values = values[rows, cols].astype(np.float32)
    flat_rewards = rewards[rows, cols].astype(np.float32)
    for name, flat in (("values", flat_values), ("rewards", flat_rewards)):
        if not np.isfinite(flat).all():
            bad = int(np.flatnonzero(~np.isfinite(flat))[0])
            raise ValueError(
                f"{name} is {flat[bad]} at row {rows[bad]}, column {cols[bad]}, a trainable "
                "id; expected finite numbers"
            )
    starts = np.flatnonzero(np.r_[True, sessions[1:] != sessions[:-1]])
    lengths = np.diff(np.r_[starts, sessions.size])
    episode = np.repeat(np.arange(starts.size), lengths)
    first = flat_rewards[starts][episode]
    if not np.array_equal(flat_rewards, first):
        bad = int(np.flatnonzero(flat_rewards != first)[0])
        raise ValueError(
            f"rewards differ within session {int(sessions[bad])} ({first[bad]} and "
            f"{flat_rewards[bad]} at row {rows[bad]}, column {cols[bad]}); expected one "
            "episode reward on every id of an episode"
        )
    step = np.arange(sessions.size) - np.repeat(starts, lengths)
    # Episode-major [E, T] in draw order, right padded: verl's response layout without the
    # observations (which its recursion skips without changing anything).
    shape = (starts.size, int(lengths.max()))
    v = np.zeros(shape, np.float32)
    r = np.zeros(shape, np.float32)
    m = np.zeros(shape, np.float32)
    v[episode, step] = flat_values
    m[episode, step] = 1.0
    r[np.arange(starts.size), lengths - 1] = flat_rewards[starts]
    adv = _recursion(r, v, m, gamma, lam)
    flat_adv = adv[episode, step]
    returns[rows, cols] = flat_adv + flat_values
    advantages[rows, cols] = _whiten(flat_adv) if whiten else flat_adv
    return advantages, returns


_whiten = whiten  # episode_gae's keyword of the same name shadows the function


def _recursion(
    rewards: np.ndarray, values: np.ndarray, mask: np.ndarray, gamma: float, lam: float
) -> np.ndarray:
    """verl's backward GAE loop over ``[E, T]`` float32 arrays, in its order of operations."""
    g = np.float32(gamma)
    gl = np.float32(gamma * lam)  # verl multiplies by the Python product gamma * lam
    nextvalues = np.zeros(values.shape[0], np.float32)
    last = np.zeros(values.shape[0], np.float32)
    out = np.zeros_like(values)
    one = np.float32(1)
    for t in range(values.shape[1] - 1, -1, -1):
        delta = rewards[:, t] + g * nextvalues - values[:, t]
        candidate = delta + gl * last
        keep = mask[:, t]
        nextvalues = values[:, t] * keep + (one - keep) * nextvalues
        last = candidate * keep + (one - keep) * last
        out[:, t] = last
    return out
