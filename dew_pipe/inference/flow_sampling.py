"""`sample_trajectory`: a rectified-flow model's SDE samples with their transition densities.

Starting from ``x_{t_0} ~ N(0, I)`` at ``t_0 = 1``, each of the ``K = steps - 1`` transitions
from ``t_k`` down to ``t_{k+1}`` (elapsed time ``h = t_k - t_{k+1}``) is the Flow-GRPO
Euler-Maruyama step of :mod:`dew_pipe.diffusion`:

    v     = v_theta(x_k, t_k, c)                              (guided when the objective is)
    mean  = x_k (1 - sigma_k^2 h / (2 t_k)) - v h (1 + sigma_k^2 (1 - t_k) / (2 t_k))
    x_k+1 = mean + sigma_k sqrt(h) * z,        z ~ N(0, I)
    log p(x_k+1 | x_k) = sum_i [ -(x_k+1,i - mean_i)^2 / (2 sigma_k^2 h) - log(sigma_k sqrt(h))
                                 - log(2 pi) / 2 ]

with ``sigma_k = a sqrt(t_k / (1 - t_k))`` (``1 - t_1`` in the denominator at ``t_0 = 1``).
A transition the caller marks deterministic, or one with ``sigma_k = 0`` (``noise_level``
0), is the Euler ODE step ``x_k+1 = x_k - h v``: it has no Gaussian density, its log density
is reported as 0 and its mark is False, and no policy loss may use it.

The whole trajectory is one compiled ``lax.scan`` (compiled once per objective, row count
and grid length).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dew_pipe._validate import check_int
from dew_pipe.diffusion import transition_log_density, transition_mean

__all__ = ["FlowTrajectory", "sample_trajectory"]


class FlowTrajectory(NamedTuple):
    """One batch of SDE sample paths (host arrays).

    Attributes:
        states: ``[N, K + 1, *latent]`` float32; ``states[:, 0]`` is the starting noise,
            ``states[:, -1]`` the sample.
        times: ``[K + 1]`` float64, the grid from 1 down to 0.
        sigmas: ``[K]`` float64, ``sigma_t`` at the start of each transition (0 where
            deterministic).
        log_densities: ``[N, K]`` float32, the joint (summed over coordinates) log density
            of each transition under the sampling policy; 0 where not stochastic.
        stochastic: ``[K]`` bool, True where the transition is a Gaussian with a density.
    """

    states: np.ndarray
    times: np.ndarray
    sigmas: np.ndarray
    log_densities: np.ndarray
    stochastic: np.ndarray

    def per_coordinate(self) -> np.ndarray:
        """``log_densities`` divided by the coordinate count (what Flow-GRPO's ratio uses)."""
        coordinates = int(np.prod(self.states.shape[2:]))
        return (self.log_densities / coordinates).astype(np.float32)


def stochastic_marks(
    process: Any, steps: int, stochastic: Sequence[bool] | np.ndarray | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(times [K+1], sigmas [K], marks [K])`` of a grid: the caller's marks, cleared where
    ``sigma_t`` is zero, and sigmas zeroed where a transition is not stochastic.

    Raises:
        ValueError: ``stochastic`` is not ``K`` booleans.
    """
    times = process.timesteps(steps)
    transitions = len(times) - 1
    if stochastic is None:
        marks = np.ones(transitions, bool)
    else:
        marks = np.asarray(stochastic)
        if marks.dtype != bool or marks.shape != (transitions,):
            raise ValueError(
                f"stochastic is {stochastic!r}; expected {transitions} booleans, one per "
                f"transition of a {steps}-point grid"
            )
    sigmas = process.sigmas(times)
    marks = marks & (sigmas > 0)
    return times, np.where(marks, sigmas, 0.0), marks


@functools.partial(jax.jit, static_argnames=("diffusion", "rows"))
def _trajectory(
    diffusion: Any,
    params: Any,
    key: jax.Array,
    conditions: Mapping[str, jax.Array],
    times: jax.Array,
    sigmas: jax.Array,
    marks: jax.Array,
    rows: int,
) -> tuple[jax.Array, jax.Array]:
    cond = diffusion.condition(params, conditions)
    start_key, step_key = jax.random.split(key)
    x = jax.random.normal(start_key, (rows, *diffusion.latent_shape), jnp.float32)

    def step(x: jax.Array, k: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        t, h, sigma, mark = times[k], times[k] - times[k + 1], sigmas[k], marks[k]
        velocity = diffusion.velocity(params, x, jnp.full((rows,), t), cond)
        mean = transition_mean(x, velocity, t, h, sigma)
        std = sigma * jnp.sqrt(h)
        noise = jax.random.normal(jax.random.fold_in(step_key, k), x.shape, x.dtype)
        following = mean + jnp.where(mark, std, 0.0) * noise
        density = transition_log_density(following, mean, jnp.where(mark, std, 1.0))
        return following, (following, jnp.where(mark, density, 0.0))

    _, (states, densities) = jax.lax.scan(step, x, jnp.arange(times.shape[0] - 1))
    states = jnp.concatenate([x[None], states])
    return jnp.moveaxis(states, 0, 1), densities.T


def sample_trajectory(
    objective: Any,
    params: Any,
    key: jax.Array,
    conditions: Mapping[str, Any] | None = None,
    *,
    rows: int,
    steps: int,
    stochastic: Sequence[bool] | np.ndarray | None = None,
) -> FlowTrajectory:
    """Sample ``rows`` SDE paths over a ``steps``-point grid (module docstring).

    Args:
        objective: a `~dew_pipe.objectives.diffusion.DiffusionObjective`, or an objective
            holding one as ``.diffusion`` (`FlowGRPOObjective`); its process, encoders,
            guidance and model are used.
        params: the variables to sample with (the live policy).
        key: PRNG key of the draw.
        conditions: the condition fields, each ``[rows, ...]`` (omit for an unconditioned
            model).
        rows: paths to draw.
        steps: time points, both ends included (``steps - 1`` transitions).
        stochastic: ``steps - 1`` booleans; False makes that transition a deterministic
            ODE step. None: every transition with ``sigma_t > 0`` is stochastic.

    Returns:
        A `FlowTrajectory` of host arrays.

    Raises:
        ValueError: ``rows < 1``, ``steps < 2``, marks of the wrong length, a missing
            condition field.
    """
    diffusion = getattr(objective, "diffusion", objective)
    rows = check_int("rows", rows, minimum=1)
    steps = check_int("steps", steps, minimum=2)
    times, sigmas, marks = stochastic_marks(diffusion.process, steps, stochastic)
    conditions = dict(conditions or {})
    needed = [field.name for field in diffusion.inputs.conditions]
    missing = sorted(set(needed) - set(conditions))
    if missing:
        raise ValueError(f"conditions lack field(s) {missing}; expected {needed}")
    arrays = {name: jnp.asarray(conditions[name]) for name in needed}
    states, densities = _trajectory(
        diffusion,
        params,
        key,
        arrays,
        jnp.asarray(times, jnp.float32),
        jnp.asarray(sigmas, jnp.float32),
        jnp.asarray(marks),
        rows,
    )
    states, densities = jax.device_get((states, densities))
    return FlowTrajectory(
        states=np.asarray(states),
        times=times,
        sigmas=sigmas,
        log_densities=np.asarray(densities),
        stochastic=marks,
    )
