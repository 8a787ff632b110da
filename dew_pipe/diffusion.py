"""The rectified-flow process: noising, the velocity target, and its stochastic sampler.

Time runs from ``t = 1`` (pure Gaussian noise) to ``t = 0`` (data). A clean sample ``x0``
and noise ``eps ~ N(0, I)`` meet on the straight line

    x_t = (1 - t) * x0 + t * eps,         the velocity target is  v = eps - x0,

so ``dx_t / dt = v`` and the model is trained to predict ``v`` ("velocity prediction").
Sampling integrates from noise to data over a grid ``1 = t_0 > t_1 > ... > t_K = 0``
(`Process.timesteps`; ``K + 1`` time points make ``K`` transitions).

Flow-GRPO (Liu et al. 2025, section 4) turns the ODE into an SDE with the same marginals,

    dx_t = [v(x_t, t) + sigma_t^2 / (2 t) * (x_t + (1 - t) v(x_t, t))] dt + sigma_t dw,
    sigma_t = a * sqrt(t / (1 - t)),        a = ``noise_level``,

whose Euler-Maruyama step from ``t`` down to ``s = t - h`` is a Gaussian transition

    x_s ~ N(mean, std^2 I),
    mean = x_t * (1 - sigma_t^2 h / (2 t)) - v * h * (1 + sigma_t^2 (1 - t) / (2 t)),
    std  = sigma_t * sqrt(h).

At ``t = 1`` the ratio ``t / (1 - t)`` is infinite; as in the released Flow-GRPO sampler
the denominator there uses the grid's second point, ``1 - t_1`` (`Process.sigmas`). A
transition with ``std == 0`` (``noise_level == 0``, or one the caller marks deterministic)
is the plain Euler ODE step ``x_s = x_t - h * v`` and has no Gaussian density.

`transition_log_density` is the joint log density of a transition (summed over
coordinates); `transition_kl` is the per-coordinate conditional KL of section 4 of the
paper between two policies' transitions from the same state, with the elapsed time ``h``
in the transition variance.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from dew_pipe._validate import check_float

__all__ = [
    "Process",
    "transition_kl",
    "transition_log_density",
    "transition_mean",
]

_TIME_SAMPLING = ("uniform", "logit_normal")
_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


def _per_row(value: jax.Array, like: jax.Array) -> jax.Array:
    """``value`` ([B] or scalar) broadcast against ``like`` ([B, ...])."""
    value = jnp.asarray(value, like.dtype)
    return value.reshape(value.shape + (1,) * (like.ndim - value.ndim))


def transition_mean(
    x: jax.Array, velocity: jax.Array, t: jax.Array, h: jax.Array, sigma: jax.Array
) -> jax.Array:
    """Mean of the SDE step from ``t`` to ``t - h`` (module docstring), per row.

    ``t``, ``h`` and ``sigma`` are scalars or ``[B]``; ``x`` and ``velocity`` are ``[B, ...]``.
    With ``sigma == 0`` this is the Euler ODE step ``x - h * v``.
    """
    t, h, sigma = (_per_row(v, x) for v in (t, h, sigma))
    drift = sigma**2 / (2.0 * t)
    return x * (1.0 - drift * h) - velocity * h * (1.0 + drift * (1.0 - t))


def transition_log_density(sample: jax.Array, mean: jax.Array, std: jax.Array) -> jax.Array:
    """Joint Gaussian log density ``log N(sample; mean, std^2 I)``, summed over all but axis 0.

    ``std`` is a scalar or ``[B]`` and must be positive (a deterministic step has no density).
    Divide by the coordinate count for the per-coordinate value Flow-GRPO's ratio uses.
    """
    std = _per_row(std, sample)
    z = (sample - mean) / std
    each = -0.5 * z**2 - jnp.log(std) - _LOG_SQRT_2PI
    return each.reshape(each.shape[0], -1).sum(axis=1)


def transition_kl(mean: jax.Array, reference_mean: jax.Array, std: jax.Array) -> jax.Array:
    """Per-coordinate KL between two Gaussian transitions from the same state, per row.

    ``KL(N(mean, s^2 I) || N(reference_mean, s^2 I)) / D = mean((mean - ref)^2) / (2 s^2)``
    with ``s = sigma_t * sqrt(h)``: the transition variance includes the elapsed time ``h``
    (Flow-GRPO section 4). ``std`` is a scalar or ``[B]``; the result is ``[B]``.

    Example:
        >>> float(transition_kl(jnp.ones((1, 2)), jnp.zeros((1, 2)), 0.5)[0])
        2.0
    """
    std = _per_row(std, mean)
    each = (mean - reference_mean) ** 2 / (2.0 * std**2)
    return each.reshape(each.shape[0], -1).mean(axis=1)


@dataclasses.dataclass(frozen=True)
class Process:
    """A rectified-flow process with velocity prediction (see the module docstring).

    Make one with ``dew_pipe.presets.Flow()()``.

    Attributes:
        noise_level: ``a`` in the SDE's ``sigma_t = a * sqrt(t / (1 - t))``; 0.7 is the
            Flow-GRPO paper's setting. 0 makes every transition deterministic.
        shift: the SD3 time shift ``t -> shift * t / (1 + (shift - 1) * t)`` applied to
            the sampling grid; 1 keeps it uniform, above 1 spends more steps at high noise.
        time_sampling: how flow-matching training draws ``t``: ``"uniform"`` on (0, 1)
            or ``"logit_normal"`` (``sigmoid`` of a standard normal, SD3's choice).
        prediction: what the model predicts; always ``"velocity"`` (``eps - x0``).
    """

    noise_level: float = 0.7
    shift: float = 1.0
    time_sampling: str = "uniform"
    prediction: str = "velocity"

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "noise_level", check_float("noise_level", self.noise_level, minimum=0.0)
        )
        object.__setattr__(self, "shift", check_float("shift", self.shift, above=0.0))
        if self.time_sampling not in _TIME_SAMPLING:
            raise ValueError(
                f"time_sampling is {self.time_sampling!r}; expected one of {list(_TIME_SAMPLING)}"
            )
        if self.prediction != "velocity":
            raise ValueError(
                f"prediction is {self.prediction!r}; expected 'velocity' (rectified flow)"
            )

    # ------------------------------------------------------------------ training

    def noisy(self, x0: jax.Array, noise: jax.Array, t: jax.Array) -> jax.Array:
        """``x_t = (1 - t) * x0 + t * noise`` with ``t`` of shape ``[B]``."""
        t = _per_row(t, x0)
        return (1.0 - t) * x0 + t * noise

    def target(self, x0: jax.Array, noise: jax.Array) -> jax.Array:
        """The velocity the model is trained to predict: ``noise - x0``."""
        return noise - x0

    def sample_times(self, key: jax.Array, rows: int) -> jax.Array:
        """``rows`` training times in the open interval (0, 1), float32."""
        if self.time_sampling == "uniform":
            return jax.random.uniform(key, (rows,), jnp.float32, 1e-5, 1.0 - 1e-5)
        return jax.nn.sigmoid(jax.random.normal(key, (rows,), jnp.float32))

    # ------------------------------------------------------------------ sampling

    def timesteps(self, steps: int) -> np.ndarray:
        """The sampling grid: ``steps`` time points from 1 down to 0, both ends included.

        Float64 on the host, shifted by ``shift``.

        Example:
            >>> Process().timesteps(5).tolist()
            [1.0, 0.75, 0.5, 0.25, 0.0]
        """
        if isinstance(steps, bool) or not isinstance(steps, int | np.integer) or steps < 2:
            raise ValueError(f"steps is {steps!r}; expected an int >= 2 (time points, both ends)")
        t = np.linspace(1.0, 0.0, int(steps), dtype=np.float64)
        return self.shift * t / (1.0 + (self.shift - 1.0) * t)

    def sigmas(self, times: np.ndarray) -> np.ndarray:
        """``sigma_t`` at the start of each of the ``K`` transitions of a grid, float64."""
        times = np.asarray(times, np.float64)
        start = times[:-1]
        denominator = 1.0 - np.minimum(start, times[1])
        return self.noise_level * np.sqrt(start / denominator)
