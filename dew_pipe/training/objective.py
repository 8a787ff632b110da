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
import numpy as np

__all__ = ["Batch", "Metrics", "Objective", "Variables", "check_shapes", "check_variables"]

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
        accumulated microbatches by it. A ``"trainable"`` metric of 0 makes the step
        consume the batch without an update (nothing to learn from; see
        :mod:`dew_pipe.training.step`).
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


def check_shapes(value: Any, expected: Any, field: str = "pretrained") -> None:
    """Check that the tree ``value`` has exactly the leaves and shapes of ``expected``.

    Args:
        value: the candidate variables, e.g. a ``pretrained=`` argument.
        expected: the tree the model defines, typically ``jax.eval_shape(model.init, ...)``
            (anything with a ``.shape`` per leaf).
        field: how to name ``value`` in errors.

    Raises:
        ValueError: a leaf the model does not define, one it defines that ``value`` lacks,
            or a leaf of another shape; each named by its path.

    Example:
        >>> import jax.numpy as jnp
        >>> check_shapes({"params": {"w": jnp.zeros(3)}}, {"params": {"w": jnp.zeros(4)}})
        Traceback (most recent call last):
        ...
        ValueError: pretrained['params']['w'] has shape (3,); the model expects (4,)
    """
    want = {
        jax.tree_util.keystr(path): tuple(leaf.shape)
        for path, leaf in jax.tree_util.tree_flatten_with_path(expected)[0]
    }
    for path, leaf in jax.tree_util.tree_flatten_with_path(value)[0]:
        name = jax.tree_util.keystr(path)
        if name not in want:
            raise ValueError(f"{field} has {name}, which the model does not define")
        shape = want.pop(name)
        if tuple(np.shape(leaf)) != shape:
            raise ValueError(
                f"{field}{name} has shape {tuple(np.shape(leaf))}; the model expects {shape}"
            )
    if want:
        raise ValueError(f"{field} lacks {next(iter(want))}, which the model defines")
