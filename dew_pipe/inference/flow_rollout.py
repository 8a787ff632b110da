"""`FlowRollout`: the trainer's Flow-GRPO rollout hook, from a source batch to transitions.

One call turns a source batch of ``B`` rows (the sample field, which only sets the batch
size, or the condition fields of ``inputs.tokenize(prompts)``) into the ``N = B * G`` rows a
`~dew_pipe.objectives.rl.flow_grpo.FlowGRPOObjective` trains on:

1. Each source row is repeated ``G = groups`` times, contiguously: row ``b * G + g`` is
   sample ``g`` of source row ``b``, and rows ``b * G .. b * G + G - 1`` are its group.
2. `sample_trajectory` draws one SDE path per row under the state's live parameters over a
   ``steps``-point grid (``steps - 1`` transitions); the samples are decoded to pixels in
   ``[-1, 1]``.
3. ``reward(images, batch)`` scores them on the host: ``images`` is ``[N, *sample shape]``
   float32, ``batch`` the repeated source batch; it returns ``N`` finite numbers. Scores are
   kept as float64 from here on (`group_advantages`): the rewards column holds them, and
   `rewards_to_bytes` is how they cross a process boundary without rounding.
4. Advantages per group: ``(r - mean) / (std + 1e-4)`` with the population standard
   deviation (``ddof = 0``), computed in float64 and then cast to float32.
5. The first ``train_steps`` stochastic transitions (all of them with None) are selected;
   a deterministic transition never is. A row whose advantage is exactly zero (a group whose
   rewards all tie) stays in the fixed-shape batch with its ``transition_mask`` cleared, so
   the update's shapes never change.

After each call :meth:`FlowRollout.metrics` reports the reward mean and standard deviation,
the share of rows with zero advantage and the transitions trained; the Trainer logs them
under ``rollout/``.

On several processes (``jax.process_count() > 1``) the source rows of every process are
gathered, in process order, byte for byte; every rank samples the whole global batch with
the same key (the trainer's replicated rng), so all ranks hold the same trajectories; the
reward runs on rank zero alone and its float64 scores reach the other ranks as bytes
(`rewards_to_bytes`), never through a float32 device array; the group statistics are
computed on the global rewards; and each process returns the rows of its own source rows
(process ``p`` of ``P`` owns the ``p``-th contiguous block of ``N / P`` rows, whole groups),
which the Trainer assembles into the global batch. One process is the special case with
nothing to gather or send. Host memory thus grows with the global rollout size.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from dew_pipe._validate import check_int
from dew_pipe.inference.flow_sampling import sample_trajectory, stochastic_marks

__all__ = ["FlowRollout", "group_advantages", "rewards_from_bytes", "rewards_to_bytes"]

#: Added to the group's standard deviation before dividing (Flow-GRPO's setting).
EPSILON = 1e-4

Reward = Callable[[np.ndarray, Mapping[str, np.ndarray]], Any]


def group_advantages(rewards: np.ndarray, groups: int) -> np.ndarray:
    """Group-normalised advantages of contiguous groups, float64 in, float32 out.

    ``rewards`` is ``[B * G]`` float64; each consecutive run of ``groups`` values is one
    group. Returns ``float32((r - mean) / (std + 1e-4))`` with the population standard
    deviation, all arithmetic in float64.

    Example:
        >>> group_advantages(np.array([1.0, 3.0, 2.0, 2.0]), 2).tolist()
        [-0.9998999834060669, 0.9998999834060669, 0.0, 0.0]
    """
    rewards = np.asarray(rewards, np.float64)
    grouped = rewards.reshape(-1, groups)
    mean = grouped.mean(axis=1, keepdims=True)
    std = grouped.std(axis=1, keepdims=True)  # ddof=0: the population standard deviation
    return ((grouped - mean) / (std + EPSILON)).reshape(-1).astype(np.float32)


def rewards_to_bytes(rewards: np.ndarray) -> bytes:
    """Float64 rewards as little-endian bytes, for transfer between processes."""
    return np.ascontiguousarray(rewards, dtype="<f8").tobytes()


def rewards_from_bytes(data: bytes) -> np.ndarray:
    """The float64 rewards `rewards_to_bytes` wrote, bit for bit."""
    return np.frombuffer(data, dtype="<f8").astype(np.float64)


def _gather_rows(array: np.ndarray) -> np.ndarray:
    """Every process's rows of ``array``, in process order, bit for bit (as raw bytes, so a
    float64 column is not narrowed by a device without x64)."""
    array = np.ascontiguousarray(array)
    raw = array.view(np.uint8).reshape(array.shape[0], -1)
    gathered = np.asarray(multihost_utils.process_allgather(raw, tiled=True), np.uint8)
    return np.ascontiguousarray(gathered).view(array.dtype).reshape(-1, *array.shape[1:])


def _broadcast_rewards(rewards: np.ndarray | None, rows: int) -> np.ndarray:
    """Rank zero's float64 rewards on every process, sent as bytes."""
    data = rewards_to_bytes(rewards) if rewards is not None else bytes(8 * rows)
    sent = multihost_utils.broadcast_one_to_all(np.frombuffer(data, np.uint8))
    return rewards_from_bytes(np.asarray(sent, np.uint8).tobytes())


def _repeat(batch: Mapping[str, Any], groups: int) -> dict[str, np.ndarray]:
    return {name: np.repeat(np.asarray(value), groups, axis=0) for name, value in batch.items()}


def _scores(result: Any, rows: int) -> np.ndarray:
    """The reward callback's result as ``[rows]`` float64, or an error naming what is wrong."""
    values = np.asarray(result)
    if values.dtype.kind not in "iuf":
        raise TypeError(
            f"reward returned dtype {values.dtype}; expected {rows} real numbers (one per sample)"
        )
    if values.shape != (rows,):
        raise ValueError(
            f"reward returned shape {values.shape}; expected ({rows},), one score per sample"
        )
    values = values.astype(np.float64)
    bad = np.flatnonzero(~np.isfinite(values))
    if len(bad):
        raise ValueError(
            f"reward returned {values[bad[0]]} for sample {bad[0]}; expected finite scores"
        )
    return values


class FlowRollout:
    """Samples ``groups`` images per source row, scores them and builds a Flow-GRPO batch.

    Args:
        objective: the `FlowGRPOObjective` being trained (its ``diffusion`` samples).
        reward: ``reward(images, batch) -> [N]`` scores for decoded ``images`` in ``[-1, 1]``
            and the repeated source ``batch``; called once per rollout on the host.
        groups: G, samples per source row (at least 2: advantages compare them).
        steps: time points of the sampling grid, both ends included (at least 2).
        train_steps: how many stochastic transitions, the first ones, each row trains on;
            None trains on all of them.
        stochastic: ``steps - 1`` booleans marking which transitions are stochastic; None
            makes every transition with noise stochastic (see `sample_trajectory`).

    Raises:
        TypeError: an objective without ``diffusion``, a reward that is not callable.
        ValueError: ``groups < 2``, ``steps < 2``, ``train_steps`` outside
            ``[1, stochastic transitions]``, or a grid without stochastic transitions.

    Example:
        See the Flow-GRPO section of the documentation: ``FlowRollout(objective, brightness,
        groups=4, steps=5, train_steps=2)`` trains on the first two of four transitions.
    """

    def __init__(
        self,
        objective: Any,
        reward: Reward,
        groups: int,
        steps: int,
        train_steps: int | None = None,
        *,
        stochastic: Sequence[bool] | np.ndarray | None = None,
    ) -> None:
        diffusion = getattr(objective, "diffusion", None)
        if diffusion is None:
            raise TypeError(
                f"objective is a {type(objective).__name__}; expected a FlowGRPOObjective "
                "(an objective with a 'diffusion' to sample through)"
            )
        if not callable(reward):
            raise TypeError(f"reward is {reward!r}; expected reward(images, batch) -> scores")
        self.objective = objective
        self.diffusion = diffusion
        self.reward = reward
        self.groups = check_int("groups", groups, minimum=2)
        self.steps = check_int("steps", steps, minimum=2)
        self.stochastic = stochastic
        self.times, self.sigmas, self.marks = stochastic_marks(diffusion.process, steps, stochastic)
        available = int(self.marks.sum())
        if available == 0:
            raise ValueError(
                f"a {steps}-point grid with noise_level {diffusion.process.noise_level} and "
                f"marks {stochastic!r} has no stochastic transition; expected at least one to "
                "train on"
            )
        self.train_steps = check_int(
            "train_steps", train_steps, minimum=1, maximum=available, allow_none=True
        )
        chosen = np.flatnonzero(self.marks)
        self.selected = chosen if train_steps is None else chosen[: self.train_steps]
        self.last_rewards: np.ndarray | None = None
        self._metrics: dict[str, float] = {}

    def __call__(self, state: Any, batch: Mapping[str, Any], key: jax.Array) -> dict[str, Any]:
        """Sample, score and lay out one source batch under ``state.params``.

        Returns:
            The Flow-GRPO batch (`FlowGRPOObjective.validate` lists its fields) plus the
            repeated condition fields: ``B * G`` rows, or on several processes the rows of
            this process's source rows (module docstring).

        Raises:
            ValueError, TypeError: a batch without the spec's fields, or a reward result
                that is not ``N`` finite real numbers (naming the sample).
        """
        inputs = self.diffusion.inputs
        local = inputs.rows(batch) * self.groups
        several = jax.process_count() > 1
        if several:
            batch = {name: _gather_rows(np.asarray(value)) for name, value in batch.items()}
        rows = inputs.rows(batch) * self.groups
        repeated = _repeat(batch, self.groups)
        conditions = inputs.condition_fields(repeated)
        trajectory = sample_trajectory(
            self.diffusion,
            state.params,
            key,
            conditions,
            rows=rows,
            steps=self.steps,
            stochastic=self.stochastic,
        )
        images = np.asarray(self.diffusion.decode(trajectory.states[:, -1]), np.float32)
        rewards = None
        if jax.process_index() == 0:
            rewards = _scores(self.reward(images, repeated), rows)
        if several:
            rewards = _broadcast_rewards(rewards, rows)
        advantages = group_advantages(rewards, self.groups)
        self.last_rewards = rewards
        selected = self.selected
        # A zero advantage contributes nothing to the policy term; its transitions are
        # cleared so that the KL term and the averaging skip them too.
        keep = (advantages != 0).astype(np.float32)
        out: dict[str, Any] = {
            "states": trajectory.states[:, selected],
            "next_states": trajectory.states[:, selected + 1],
            "times": np.broadcast_to(trajectory.times[selected], (rows, len(selected))),
            "next_times": np.broadcast_to(trajectory.times[selected + 1], (rows, len(selected))),
            "sigmas": np.broadcast_to(trajectory.sigmas[selected], (rows, len(selected))),
            "old_log_probs": trajectory.per_coordinate()[:, selected],
            "transition_mask": np.repeat(keep[:, None], len(selected), axis=1),
            "advantages": advantages,
            "rewards": rewards,
        }
        for name in ("times", "next_times", "sigmas"):
            out[name] = np.ascontiguousarray(out[name], np.float32)
        out.update(conditions)
        self._metrics = {
            "reward/mean": float(rewards.mean()),
            "reward/std": float(rewards.std()),
            "advantage/zero": float((advantages == 0).mean()),
            "transitions": float(keep.sum() * len(selected)),
        }
        if several:  # this process's rows: the block of its own source rows, whole groups
            start = jax.process_index() * local
            out = {name: value[start : start + local] for name, value in out.items()}
        return out

    def metrics(self) -> dict[str, float]:
        """Numbers about the last call (reward mean/std, zero-advantage share, transitions)."""
        return dict(self._metrics)
