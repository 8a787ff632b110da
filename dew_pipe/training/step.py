"""TrainState and the pure update step the Trainer compiles.

One call of the update consumes one batch (a microbatch when accumulating):

1. ``loss, metrics = objective.loss(params, batch, key, ema)`` and its gradient.
2. NaN guard: a non-finite loss or gradient norm either leaves the whole state as it
   was (``"raise"``: the host then raises :class:`NonFiniteError`) or consumes the
   batch without learning from it (``"skip"``).
3. Accumulation: with ``accumulate=k`` the gradient is added to a buffer and the
   optimizer runs on every k-th accepted microbatch, like ``optax.MultiSteps``.
   Microbatch gradients are weighted by the objective's ``"loss_weight"`` metric,
   else its ``"tokens"`` metric, else equally. The weight is what the loss averages
   over (tokens for a token mean, pairs for DPO's mean over pairs), so
   ``sum_i w_i * grad_i / sum_i w_i`` is exactly the gradient of the mean over the
   concatenated batch.
4. EMA after each committed update: ``ema = decay * ema + (1 - decay) * params``;
   ``decay == 1`` is never computed, so a frozen reference stays bit-identical.

An objective may report a scalar ``"trainable"`` metric: where it is 0 (False) the batch
has nothing to learn from (a PPO cohort without a trainable action id) and the step
consumes it without an update, as the NaN guard's "skip" does: params, optimizer state,
accumulation window, EMA and ``updates`` stay as they were, so even a stateful optimizer
(Adam's moments) does not move. Objectives that do not report it always update.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import optax

from dew_pipe.training.objective import Objective, Variables

__all__ = [
    "Accumulation",
    "NonFiniteError",
    "TrainState",
    "build_update",
    "init_state",
    "learning_rate",
]

Guard = str | None  # "raise", "skip" or None


@flax.struct.dataclass
class TrainState:
    """Everything a training run carries from step to step.

    Attributes:
        step: int32 scalar, batches (microbatches) consumed by ``fit``.
        updates: int32 scalar, optimizer updates committed. Equal to ``step`` without
            accumulation or skipped batches.
        params: the variables being trained, ``{"params": ...}``.
        opt_state: the optimizer's state; with ``accumulate > 1`` an
            :class:`Accumulation` wrapping it.
        ema: the moving average of ``params`` (``None`` when the objective's
            ``ema_decay`` is ``None``; a frozen reference when it is 1).
        rng: typed PRNG key; split once per step.

    Example:
        >>> state = trainer.initial_state()  # doctest: +SKIP
        >>> int(state.step), int(state.updates)  # doctest: +SKIP
        (0, 0)
    """

    step: jax.Array
    updates: jax.Array
    params: Variables
    opt_state: optax.OptState
    ema: Variables | None
    rng: jax.Array


class NonFiniteError(FloatingPointError):
    """The loss or gradient of a step was NaN or infinite.

    Attributes:
        step: the step that failed (``state.step`` it would have reached).
        metrics: that step's metrics, as floats.
        state: the state before the failed step (nothing was applied).
    """

    def __init__(self, message: str, step: int, metrics: dict[str, float], state: TrainState):
        super().__init__(message)
        self.step = step
        self.metrics = metrics
        self.state = state


class Accumulation(NamedTuple):
    """Optimizer state while accumulating gradients over ``accumulate`` microbatches.

    Attributes:
        inner: the wrapped optimizer's state.
        grad_sum: sum of weighted microbatch gradients since the last update.
        weight_sum: float32, sum of the weights (token counts, or 1 per microbatch).
        count: int32, microbatches accumulated since the last update.
    """

    inner: optax.OptState
    grad_sum: Any
    weight_sum: jax.Array
    count: jax.Array


def init_state(
    objective: Objective, optimizer: optax.GradientTransformation, key: jax.Array, accumulate: int
) -> TrainState:
    """Build the initial state from ``key`` (traceable: the Trainer jits it).

    ``key`` is split into the init key and the run's rng, so the same key gives the
    same run whether the state is built eagerly or under ``jax.jit``.
    """
    init_key, rng = jax.random.split(key)
    params = objective.init(init_key)
    opt_state = optimizer.init(params)
    if accumulate > 1:
        opt_state = Accumulation(
            inner=opt_state,
            grad_sum=jax.tree.map(jnp.zeros_like, params),
            weight_sum=jnp.zeros((), jnp.float32),
            count=jnp.zeros((), jnp.int32),
        )
    ema = None
    if objective.ema_decay is not None:
        reference = getattr(objective, "reference", None)
        source = params if reference is None else reference(params)
        # A distinct copy: params and ema are donated separately.
        ema = jax.tree.map(jnp.copy, source)
    zero = jnp.zeros((), jnp.int32)
    return TrainState(step=zero, updates=zero, params=params, opt_state=opt_state, ema=ema, rng=rng)


def learning_rate(opt_state: optax.OptState) -> jax.Array | None:
    """The learning rate stored in ``opt_state`` (``optax.inject_hyperparams``), if any."""
    try:
        value = optax.tree_utils.tree_get(opt_state, "learning_rate")
    except (KeyError, ValueError, TypeError):
        return None
    if value is None or jnp.ndim(value) != 0:
        return None
    return jnp.asarray(value, jnp.float32)


def _check_metrics(metrics: Any) -> dict[str, jax.Array]:
    if not isinstance(metrics, Mapping):
        raise TypeError(
            f"objective.loss returned metrics of type {type(metrics).__name__}; expected a dict"
        )
    out = {}
    for name, value in metrics.items():
        if jnp.ndim(value) != 0:
            raise ValueError(
                f"objective metric {name!r} has shape {jnp.shape(value)}; expected a scalar"
            )
        out[str(name)] = jnp.asarray(value)
    return out


def _ema(decay: float | None, ema: Variables | None, params: Variables) -> Variables | None:
    if ema is None or decay == 1.0:
        return ema

    def mix(e: jax.Array, p: jax.Array) -> jax.Array:
        # float32 arithmetic: in bfloat16, (1 - decay) * p would mostly round away.
        mixed = decay * e.astype(jnp.float32) + (1.0 - decay) * p.astype(jnp.float32)
        return mixed.astype(e.dtype)

    return jax.tree.map(mix, ema, params)


def build_update(
    objective: Objective,
    optimizer: optax.GradientTransformation,
    *,
    accumulate: int,
    guard: Guard,
) -> Callable[[TrainState, Mapping[str, jax.Array]], tuple[TrainState, dict[str, jax.Array]]]:
    """Return ``update(state, batch) -> (state, metrics)``, pure and jit-able.

    ``metrics`` holds the objective's metrics, ``loss``, ``grad_norm`` (of this
    batch's gradient), ``learning_rate`` when discoverable, and two booleans:
    ``finite`` (the guard's verdict) and ``committed`` (an optimizer update ran).
    """
    decay = objective.ema_decay

    def commit(state: TrainState, grads: Any, opt_state: Any) -> TrainState:
        updates, opt_state = optimizer.update(grads, opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return state.replace(
            params=params,
            opt_state=opt_state,
            ema=_ema(decay, state.ema, params),
            updates=state.updates + 1,
        )

    def learn(state: TrainState, grads: Any, weight: jax.Array) -> tuple[TrainState, jax.Array]:
        if accumulate == 1:
            return commit(state, grads, state.opt_state), jnp.array(True)
        acc: Accumulation = state.opt_state
        acc = acc._replace(
            grad_sum=jax.tree.map(lambda s, g: s + weight * g, acc.grad_sum, grads),
            weight_sum=acc.weight_sum + weight,
            count=acc.count + 1,
        )
        full = acc.count == accumulate

        def apply(state: TrainState) -> TrainState:
            # An all-padding window has weight 0 and a zero gradient; it still commits.
            scale = jnp.where(acc.weight_sum > 0, 1.0 / acc.weight_sum, 0.0)
            mean = jax.tree.map(lambda s: (s * scale).astype(s.dtype), acc.grad_sum)
            state = commit(state, mean, acc.inner)
            reset = Accumulation(
                inner=state.opt_state,
                grad_sum=jax.tree.map(jnp.zeros_like, acc.grad_sum),
                weight_sum=jnp.zeros_like(acc.weight_sum),
                count=jnp.zeros_like(acc.count),
            )
            return state.replace(opt_state=reset)

        def hold(state: TrainState) -> TrainState:
            return state.replace(opt_state=acc)

        return jax.lax.cond(full, apply, hold, state), full

    def update(
        state: TrainState, batch: Mapping[str, jax.Array]
    ) -> tuple[TrainState, dict[str, jax.Array]]:
        rng, key = jax.random.split(state.rng)
        grad_fn = jax.value_and_grad(objective.loss, has_aux=True)
        (loss, metrics), grads = grad_fn(state.params, batch, key, state.ema)
        if jnp.ndim(loss) != 0:
            raise ValueError(f"objective.loss returned shape {jnp.shape(loss)}; expected a scalar")
        metrics = _check_metrics(metrics)
        weight = jnp.asarray(metrics.get("loss_weight", metrics.get("tokens", 1.0)), jnp.float32)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        lr = learning_rate(state.opt_state.inner if accumulate > 1 else state.opt_state)
        advanced = state.replace(step=state.step + 1, rng=rng)

        def maybe_learn(s: TrainState) -> tuple[TrainState, jax.Array]:
            if "trainable" not in metrics:
                return learn(s, grads, weight)
            return jax.lax.cond(
                metrics["trainable"].astype(bool),
                lambda s: learn(s, grads, weight),
                lambda s: (s, jnp.array(False)),
                s,
            )

        if guard is None:
            new, committed = maybe_learn(advanced)
        else:
            # "raise" hands back the untouched state so the host can raise on it;
            # "skip" consumes the batch (step and rng advance) without learning.
            fallback = state if guard == "raise" else advanced
            new, committed = jax.lax.cond(
                finite,
                maybe_learn,
                lambda s: (fallback, jnp.array(False)),
                advanced,
            )
        out = dict(metrics)
        out.update(loss=loss, grad_norm=grad_norm, finite=finite, committed=committed)
        if lr is not None:
            out["learning_rate"] = lr
        return new, out

    return update
