"""`PPORollout`: tool episodes with critic values and GAE targets, for ``PPOObjective``.

One call (the Trainer's rollout hook):

1. ``EpisodeRollout`` collects ``groups`` episodes per task under the Trainer's state and
   packs them (its policy, ``objective.policy(variables)``, binds the state's policy
   subtree). Raw likelihoods land in ``old_log_probs``, behavior ones in
   ``behavior_log_probs``; truncated and failed episodes get no rows.
2. The critic scores the packed rows under the same state (``objective.values``, jitted):
   the value before every sampled id becomes ``old_values``.
3. :func:`~dew_pipe.objectives.rl.gae.episode_gae` runs GAE over each episode's actions
   in draw order, across tool turns, chains and rows, with the verifier's reward on the
   episode's last action and no bootstrap after it; the advantages are whitened over all
   the cohort's actions; ``returns = GAE + old_values`` are the critic's targets.

The result is the packed batch with ``old_values``, ``advantages`` and ``returns`` added
or replaced, each ``[N, W]`` like ``input_ids`` and 0 off the sampled ids. It is a plain
batch: write it with ``dew_pipe.batches.write_parquet`` (the packed-rows schema has the
PPO columns) and train several PPO epochs on it from a ``Dataset`` without sampling again.

A cohort with exactly one trainable action id is refused (its whitening is undefined). One
with none (every episode truncated, say) gets zero targets, and ``PPOObjective`` reports it
as not trainable, so the Trainer consumes the batch without an update.

Whitening is over the actions this process collected; on several JAX processes each
process would whiten its own share, which is not the global set, so PPORollout refuses to
run there.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from dew_pipe._validate import check_float
from dew_pipe.objectives.rl.gae import episode_gae

__all__ = ["PPORollout", "episode_rewards"]


def episode_rewards(batch: Mapping[str, np.ndarray], episodes: Any) -> np.ndarray:
    """``[N, W]`` float32: each sampled id's episode reward (0 elsewhere).

    Args:
        batch: packed rows of ``episodes`` (``session_index`` refers to their positions).
        episodes: the episodes, in ``session_index`` order.

    Raises:
        ValueError: a trainable id of an episode without a reward.
    """
    mask = np.asarray(batch["response_mask"]) == 1
    sessions = np.asarray(batch["session_index"])
    rewards = np.full(len(episodes), np.nan, np.float32)
    for i, episode in enumerate(episodes):
        if episode.reward is not None:
            rewards[i] = episode.reward
    out = np.zeros(mask.shape, np.float32)
    out[mask] = rewards[sessions[mask]]
    if np.isnan(out[mask]).any():
        index = int(sessions[mask][np.isnan(out[mask])][0])
        raise ValueError(f"{episodes[index].describe()} trains but has no reward")
    return out


class PPORollout:
    """The Trainer's rollout for PPO on tool episodes (see the module docstring).

    Args:
        objective: the :class:`~dew_pipe.objectives.rl.ppo.PPOObjective` being trained.
        episodes: an ``EpisodeRollout`` whose policy is ``objective.policy(variables)``
            and whose packed width is ``objective.seq_len + 1``.
        gamma: discount per action id, in ``[0, 1]`` (1: undiscounted, verl's default).
        lam: GAE's lambda, in ``[0, 1]`` (0.95, verl's default).

    Raises:
        TypeError: an objective without ``values``, an episodes rollout without
            ``collect``.
        ValueError: ``gamma`` or ``lam`` out of range; a width that is not ``seq_len + 1``;
            more than one JAX process.

    Example:
        >>> rollout = PPORollout(objective, episodes, gamma=.97, lam=.9)   # doctest: +SKIP
        >>> batch = rollout(state, {"task_id": np.array([0, 1])}, key)     # doctest: +SKIP
        >>> sorted(set(batch) & {"old_values", "advantages", "returns"})    # doctest: +SKIP
        ['advantages', 'old_values', 'returns']
    """

    def __init__(self, objective: Any, episodes: Any, gamma: float = 1.0, lam: float = 0.95):
        if not callable(getattr(objective, "values", None)):
            raise TypeError(
                f"objective is a {type(objective).__name__}; expected a PPOObjective (it has "
                "no values(params, batch))"
            )
        if not callable(getattr(episodes, "collect", None)):
            raise TypeError(f"episodes is a {type(episodes).__name__}; expected an EpisodeRollout")
        self.gamma = check_float("gamma", gamma, minimum=0.0, maximum=1.0)
        self.lam = check_float("lam", lam, minimum=0.0, maximum=1.0)
        width = getattr(episodes, "width", None)
        if width != objective.seq_len + 1:
            raise ValueError(
                f"the episodes pack rows {width} ids wide but PPOObjective(seq_len="
                f"{objective.seq_len}) trains rows of {objective.seq_len + 1}; expected "
                "max_prompt_tokens + max_new_tokens = seq_len + 1"
            )
        if jax.process_count() > 1:
            raise ValueError(
                f"PPORollout runs on {jax.process_count()} JAX processes; it whitens over the "
                "actions one process collects, so it expects a single process"
            )
        self.objective = objective
        self.episodes = episodes
        self._values = jax.jit(objective.values)
        self._metrics: dict[str, float] = {}

    def __call__(self, state: Any, batch: Mapping[str, Any], key: jax.Array) -> dict[str, Any]:
        """Collects, scores and prepares one cohort under ``state``.

        Returns:
            The packed columns plus ``old_values``, ``advantages`` and ``returns``.

        Raises:
            EpisodeFailure / EpisodeCancelled: as ``EpisodeRollout``.
            ValueError: a cohort with exactly one trainable action id.
        """
        packed = dict(self.episodes(state, batch, key))
        rewards = episode_rewards(packed, self.episodes.last_episodes)
        mask = packed["response_mask"] == 1
        actions = int(mask.sum())
        if actions == 1:
            raise ValueError(
                "the cohort has exactly one trainable action id; its whitened advantage is "
                "undefined (collect more episodes per batch, or longer ones)"
            )
        values = np.zeros(mask.shape, np.float32)
        if actions:
            values = np.where(mask, np.asarray(self._values(state.params, packed)), 0.0)
        advantages, returns = episode_gae(packed, values, rewards, gamma=self.gamma, lam=self.lam)
        packed["old_values"] = values.astype(np.float32)
        packed["advantages"] = advantages
        packed["returns"] = returns
        self._metrics = self._summary(mask, values, returns)
        return packed

    def _summary(self, mask: np.ndarray, values: np.ndarray, returns: np.ndarray) -> dict:
        out = dict(self.episodes.metrics())
        out["ppo/actions"] = float(mask.sum())
        if mask.any():
            out["ppo/values"] = float(values[mask].mean())
            out["ppo/returns"] = float(returns[mask].mean())
            out["ppo/value_error"] = float(np.square(returns[mask] - values[mask]).mean())
        return out

    def checkpointed(self, step: int) -> None:
        """Passed on to the wrapped episodes, so their journal is pruned at each checkpoint."""
        checkpointed = getattr(self.episodes, "checkpointed", None)
        if callable(checkpointed):
            checkpointed(step)

    def metrics(self) -> dict[str, float]:
        """The episodes' metrics of the last call and ``ppo/actions`` (trainable ids),
        ``ppo/values``, ``ppo/returns`` and ``ppo/value_error`` (means over them: what the
        critic predicted, its targets and their squared difference before the update)."""
        return dict(self._metrics)
