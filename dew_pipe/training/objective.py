"""The Objective protocol: what the Trainer needs from a loss.

It lives with the Trainer, which defines the contract; the objectives (``dew_pipe.objectives``,
a floor above) implement it and import their shared types from here
(``dew_pipe.objectives.Objective`` names the same class).

An objective is a small object holding a model and its settings. It owns how
variables are created (:meth:`Objective.init`) and the pure loss the Trainer
differentiates; the Trainer owns everything around it (optimizer, EMA, gradient
accumulation, data parallelism, NaN guard, checkpoints, logging).

Optional methods the Trainer looks for with ``getattr``:

* ``validate(batch)``: host-side check of a NumPy batch before it reaches a compiled
  function; raises ``ValueError`` naming the field, its shape or value, and what was
  expected.
* ``reference(params)``: the variables the EMA slot starts from (default: ``params``).
  DPO and GRPO keep their frozen reference there with ``ema_decay == 1.0``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import jax

__all__ = ["Batch", "Metrics", "Objective", "Variables", "check_variables"]

Variables = Mapping[str, Any]
"""A full Flax variables mapping: ``{"params": {...}}`` plus any other collections."""

Batch = Mapping[str, jax.Array]
Metrics = dict[str, jax.Array]


@runtime_checkable
class Objective(Protocol):
    """What :class:`dew_pipe.Trainer` trains.

    Attributes:
        ema_decay: ``None`` keeps no EMA tree; a float in ``[0, 1]`` keeps
            ``ema = decay * ema + (1 - decay) * params`` after every optimizer update;
            ``1.0`` is a frozen reference that never moves.

    Example:
        A minimal objective (least squares on a linear model)::

            class Linear:
                ema_decay = None

                def init(self, key):
                    return {"params": {"w": jax.random.normal(key, (3,))}}

                def loss(self, params, batch, key, ema):
                    error = batch["x"] @ params["params"]["w"] - batch["y"]
                    loss = jnp.mean(error**2)
                    return loss, {"loss": loss}

                def evaluate(self, params, batch):
                    error = batch["x"] @ params["params"]["w"] - batch["y"]
                    return {"squared_error": jnp.sum(error**2), "count": error.size * 1.0}

                def summarize(self, totals):
                    return {"mse": totals["squared_error"] / totals["count"]}
    """

    ema_decay: float | None

    def init(self, key: jax.Array) -> Variables:
        """Fresh variables: a random initialization, or a copy of ``pretrained``."""
        ...

    def loss(
        self, params: Variables, batch: Batch, key: jax.Array, ema: Variables | None
    ) -> tuple[jax.Array, Metrics]:
        """Scalar loss and scalar metrics; pure, traced under ``jax.jit``.

        Metrics should include ``"tokens"`` (loss-bearing tokens, float) when the
        objective has such a notion: the Trainer reports tokens/s from it and weights
        accumulated microbatches by it.
        """
        ...

    def evaluate(self, params: Variables, batch: Batch) -> Metrics:
        """Additive sums over one validation batch (they are summed over batches)."""
        ...

    def summarize(self, totals: Mapping[str, float]) -> dict[str, float]:
        """Turn summed ``evaluate`` outputs into reported numbers (e.g. perplexity)."""
        ...


def check_variables(value: Any, field: str) -> Variables:
    """Check that ``value`` is a full Flax variables mapping with a ``params`` collection.

    Args:
        value: the candidate, e.g. a ``pretrained=`` argument.
        field: how to name it in errors.

    Returns:
        ``value`` unchanged.

    Raises:
        TypeError: when ``value`` is not a mapping.
        ValueError: when it has no ``"params"`` key (a bare parameter tree).

    Example:
        >>> check_variables({"params": {"w": 1.0}}, "pretrained")
        {'params': {'w': 1.0}}
    """
    if not isinstance(value, Mapping):
        raise TypeError(
            f"{field} is a {type(value).__name__}; expected a variables mapping {{'params': ...}}"
        )
    if "params" not in value:
        keys = sorted(map(str, value))[:5]
        raise ValueError(
            f"{field} has keys {keys}; expected a full variables mapping with a 'params' "
            "collection (wrap a bare tree as {'params': tree})"
        )
    return value
