"""DiffusionObjective: flow-matching training of a velocity model, and what Flow-GRPO reuses.

The objective owns the pieces every rectified-flow objective shares:

* the `~dew_pipe.inputs.InputSpec` (the sample field the model generates and the condition
  fields it is given);
* the condition encoders, one Flax module per condition field, each mapping that field's
  array to a ``[B, emb_features]`` vector; their outputs are summed into the model's
  ``cond`` and trained with the model;
* an optional frozen autoencoder: ``encode(pixels) -> latents`` before noising,
  ``decode(latents) -> pixels`` after sampling (both pure JAX functions); without one the
  model works on pixels in ``[-1, 1]`` directly;
* classifier-free guidance: with ``guidance = w`` the velocity is
  ``v_u + w * (v_c - v_u)``, ``v_u`` computed with the zero (null) condition.

Variables are ``{"params": {"model": ..., "encoders": {field: ...}}}``.

The flow-matching loss (Lipman et al. 2023; Liu et al. 2023, rectified flow) draws
``t`` from the process, ``eps ~ N(0, I)``, and regresses the velocity:

    loss = mean || v_theta((1 - t) x0 + t eps, t, c) - (eps - x0) ||^2

With ``condition_dropout = p`` each row's condition is replaced by the null condition
with probability ``p``, which is what guidance needs at sampling time.

Example:
    >>> from dew_pipe import Field, InputSpec, models, presets
    >>> model = models.SimpleDiT(output_channels=1, patch_size=2, emb_features=8,
    ...                          num_layers=1, num_heads=2, mlp_ratio=2)
    >>> objective = DiffusionObjective(model, presets.Flow()(), InputSpec(Field("image", (4, 4, 1))))
    >>> variables = objective.init(jax.random.key(0))
    >>> batch = {"image": np.zeros((2, 4, 4, 1), np.uint8)}
    >>> loss, metrics = objective.loss(variables, batch, jax.random.key(1), None)
    >>> objective.sample(variables, jax.random.key(2), batch).shape
    (2, 4, 4, 1)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dew_pipe._validate import check_float, check_int
from dew_pipe.diffusion import Process
from dew_pipe.inputs import InputSpec, pixels
from dew_pipe.training.objective import Batch, Metrics, Variables, check_shapes, check_variables

__all__ = ["DiffusionObjective"]

# Evaluation draws its noise and times from this fixed key, so that validation losses of
# different steps are measured on the same draws and can be compared.
_EVAL_SEED = 0x45564C


class DiffusionObjective:
    """Flow-matching training of ``model`` on the sample field of ``inputs``.

    Args:
        model: a Flax module, ``model.apply(variables, x, t, cond=None) -> velocity`` with
            ``x`` shaped like a batch of latents (the sample field, or the autoencoder's
            latents), ``t [B]`` and ``cond [B, D]`` (e.g. `dew_pipe.models.SimpleDiT`).
        process: the rectified-flow `~dew_pipe.diffusion.Process` (``presets.Flow()()``).
        inputs: the `~dew_pipe.inputs.InputSpec`.
        encoders: ``{condition field name: Flax module}``, one per condition field of
            ``inputs``; each maps ``[B, *field.shape]`` to ``[B, D]``.
        autoencoder: ``None``, or an object with ``encode(pixels)`` and ``decode(latents)``
            (pure JAX, not trained).
        guidance: ``None`` (no guidance), or the classifier-free guidance scale ``w >= 0``;
            needs at least one condition field.
        condition_dropout: probability of training a row on the null condition.
        steps: time points (both ends included) that `sample` integrates over.
        eval_metrics: ``{name: metric(images, batch) -> [B]}``, the metric consumers of
            evaluation: each validation batch is sampled (the live parameters, ``steps``
            points, fixed noise) and each metric's per-row values are averaged over the
            validation set. A batch with the sample field also reports the flow-matching
            ``loss``; a prompt-only batch (``inputs.tokenize(prompts)``) needs a metric.
        pretrained: starting variables (as `init` makes them, e.g. the final
            ``state.params`` of a pretraining run), copied at init instead of a random
            initialisation.

    Raises:
        TypeError: a process that is not a `Process`, inputs that are not an `InputSpec`,
            an autoencoder without ``encode``/``decode``.
        ValueError: encoders that do not match the condition fields one to one, guidance
            without conditions, an out-of-range setting, ``pretrained`` variables whose
            names or shapes differ from the model's (naming the first difference).
    """

    ema_decay: float | None = None

    def __init__(
        self,
        model: Any,
        process: Process,
        inputs: InputSpec,
        *,
        encoders: Mapping[str, Any] | None = None,
        autoencoder: Any = None,
        guidance: float | None = None,
        condition_dropout: float = 0.0,
        steps: int = 20,
        eval_metrics: Mapping[str, Callable[[jax.Array, Batch], jax.Array]] | None = None,
        pretrained: Variables | None = None,
    ) -> None:
        if not callable(getattr(model, "apply", None)) or not callable(
            getattr(model, "init", None)
        ):
            raise TypeError(f"model is {model!r}; expected a Flax module (init, apply)")
        if not isinstance(process, Process):
            raise TypeError(
                f"process is {process!r}; expected a dew_pipe.diffusion.Process (presets.Flow()())"
            )
        if not isinstance(inputs, InputSpec):
            raise TypeError(f"inputs is {inputs!r}; expected a dew_pipe.InputSpec")
        encoders = dict(encoders or {})
        names = {field.name for field in inputs.conditions}
        if set(encoders) != names:
            raise ValueError(
                f"encoders cover fields {sorted(encoders)} but the condition fields are "
                f"{sorted(names)}; expected one encoder per condition field"
            )
        if autoencoder is not None and not (
            callable(getattr(autoencoder, "encode", None))
            and callable(getattr(autoencoder, "decode", None))
        ):
            raise TypeError(
                f"autoencoder is {autoencoder!r}; expected None or an object with "
                "encode(pixels) and decode(latents)"
            )
        guidance = check_float("guidance", guidance, minimum=0.0, allow_none=True)
        if guidance is not None and not names:
            raise ValueError(
                f"guidance is {guidance}, but {inputs!r} has no condition field; expected "
                "guidance=None for an unconditioned model"
            )
        self.model = model
        self.process = process
        self.inputs = inputs
        self.encoders = encoders
        self.autoencoder = autoencoder
        self.guidance = guidance
        self.condition_dropout = check_float(
            "condition_dropout", condition_dropout, minimum=0.0, maximum=1.0
        )
        self.steps = check_int("steps", steps, minimum=2)
        self.eval_metrics = dict(eval_metrics or {})
        for name, metric in self.eval_metrics.items():
            if not callable(metric) or name in ("loss", "squared_error", "count", "samples"):
                raise ValueError(
                    f"eval_metrics[{name!r}] is {metric!r}; expected a callable "
                    "metric(images, batch) -> [B] under a name other than loss, "
                    "squared_error, count and samples"
                )
        sample = jax.ShapeDtypeStruct((1, *inputs.sample.shape), jnp.float32)
        self.latent_shape: tuple[int, ...] = tuple(
            jax.eval_shape(self._encode_pixels, sample).shape[1:]
        )
        self.coordinates = math.prod(self.latent_shape)
        self.pretrained = None
        if pretrained is not None:
            self.pretrained = check_variables(pretrained, "pretrained")
            self._check_pretrained()

    def _check_pretrained(self) -> None:
        check_shapes(self.pretrained, jax.eval_shape(self._fresh, jax.random.key(0)))

    # ------------------------------------------------------------------ variables

    def init(self, key: jax.Array) -> Variables:
        """A copy of ``pretrained``, or fresh variables for the model and every encoder."""
        if self.pretrained is not None:
            # A copy: the trainer donates its parameters, the caller keeps theirs.
            return jax.tree.map(jnp.array, self.pretrained)
        return self._fresh(key)

    def _fresh(self, key: jax.Array) -> Variables:
        model_key, *encoder_keys = jax.random.split(key, 1 + len(self.encoders))
        params: dict[str, Any] = {}
        cond = None
        if self.encoders:
            params["encoders"] = {}
            for (name, encoder), k in zip(sorted(self.encoders.items()), encoder_keys, strict=True):
                field = next(f for f in self.inputs.conditions if f.name == name)
                dtype = jnp.int32 if field.tokenizer is not None else jnp.float32
                example = jnp.zeros((1, *field.shape), dtype)
                params["encoders"][name] = encoder.init(k, example)["params"]
            cond = self.condition({"params": params}, self._example_conditions())
        x = jnp.zeros((1, *self.latent_shape), jnp.float32)
        t = jnp.ones((1,), jnp.float32)
        params["model"] = self.model.init(model_key, x, t, cond)["params"]
        return {"params": params}

    def _example_conditions(self) -> dict[str, jax.Array]:
        return {
            f.name: jnp.zeros((1, *f.shape), jnp.int32 if f.tokenizer is not None else jnp.float32)
            for f in self.inputs.conditions
        }

    # ------------------------------------------------------------------ pieces

    def _encode_pixels(self, images: jax.Array) -> jax.Array:
        if self.autoencoder is None:
            return images
        return self.autoencoder.encode(images)

    def encode(self, batch: Batch) -> jax.Array:
        """The sample field of ``batch`` as clean latents ``x0`` (pixels in [-1, 1], encoded)."""
        return self._encode_pixels(pixels(batch[self.inputs.sample.name]))

    def decode(self, latents: jax.Array) -> jax.Array:
        """Latents as pixels in ``[-1, 1]`` (decoded, then clipped)."""
        images = latents if self.autoencoder is None else self.autoencoder.decode(latents)
        return jnp.clip(images, -1.0, 1.0)

    def condition(self, params: Variables, conditions: Mapping[str, jax.Array]) -> jax.Array | None:
        """The summed encoder outputs ``[B, D]`` for the condition fields, or None without any."""
        if not self.encoders:
            return None
        total = None
        for name, encoder in sorted(self.encoders.items()):
            out = encoder.apply({"params": params["params"]["encoders"][name]}, conditions[name])
            total = out if total is None else total + out
        return total

    def _apply(self, params: Variables, x: jax.Array, t: jax.Array, cond: jax.Array | None):
        return self.model.apply({"params": params["params"]["model"]}, x, t, cond)

    def velocity(
        self, params: Variables, x: jax.Array, t: jax.Array, cond: jax.Array | None
    ) -> jax.Array:
        """The model's velocity at ``(x, t)``, guided when ``guidance`` is set.

        ``t`` is ``[B]``; ``cond`` is ``[B, D]`` or None.
        """
        if self.guidance is None or cond is None:
            return self._apply(params, x, t, cond)
        both = self._apply(
            params,
            jnp.concatenate([x, x]),
            jnp.concatenate([t, t]),
            jnp.concatenate([cond, jnp.zeros_like(cond)]),
        )
        conditioned, unconditioned = jnp.split(both, 2)
        return unconditioned + self.guidance * (conditioned - unconditioned)

    # ------------------------------------------------------------------ training

    def _squared_errors(
        self, params: Variables, batch: Batch, key: jax.Array, dropout: bool
    ) -> jax.Array:
        if self.inputs.sample.name not in batch:  # checked while tracing, before any compile
            raise ValueError(
                f"batch has no sample field {self.inputs.sample.name!r} (fields "
                f"{sorted(batch)}); flow matching needs the clean samples"
            )
        x0 = self.encode(batch)
        rows = x0.shape[0]
        time_key, noise_key, drop_key = jax.random.split(key, 3)
        t = self.process.sample_times(time_key, rows)
        noise = jax.random.normal(noise_key, x0.shape, x0.dtype)
        cond = self.condition(params, {f.name: batch[f.name] for f in self.inputs.conditions})
        if cond is not None and dropout and self.condition_dropout > 0:
            keep = jax.random.bernoulli(drop_key, 1.0 - self.condition_dropout, (rows, 1))
            cond = jnp.where(keep, cond, 0.0)
        # Training regresses the model itself: guidance is a sampling-time mixture.
        predicted = self._apply(params, self.process.noisy(x0, noise, t), t, cond)
        error = (predicted - self.process.target(x0, noise)) ** 2
        return error.reshape(rows, -1).mean(axis=1)

    def loss(
        self, params: Variables, batch: Batch, key: jax.Array, ema: Variables | None
    ) -> tuple[jax.Array, Metrics]:
        """Flow-matching loss: mean squared velocity error over rows and coordinates."""
        per_row = self._squared_errors(params, batch, key, dropout=True)
        loss = per_row.mean()
        rows = jnp.asarray(per_row.shape[0], jnp.float32)
        return loss, {"loss": loss, "loss_weight": rows}

    def evaluate(self, params: Variables, batch: Batch) -> Metrics:
        """Sums over one validation batch, all on fixed draws (the same for every evaluation).

        With the sample field: the summed squared velocity error and its row count. With
        ``eval_metrics``: each metric's sum over samples drawn from the batch, and the
        sample count.
        """
        key = jax.random.key(_EVAL_SEED)
        sums: dict[str, jax.Array] = {}
        if self.inputs.sample.name in batch:
            per_row = self._squared_errors(params, batch, key, dropout=False)
            sums["squared_error"] = per_row.sum()
            sums["count"] = jnp.asarray(per_row.shape[0], jnp.float32)
        if self.eval_metrics:
            images = self.sample(params, jax.random.fold_in(key, 1), batch)
            for name, metric in sorted(self.eval_metrics.items()):
                values = jnp.asarray(metric(images, batch), jnp.float32)
                if values.shape != (images.shape[0],):
                    raise ValueError(
                        f"eval_metrics[{name!r}] returned shape {values.shape}; expected "
                        f"({images.shape[0]},), one value per sample"
                    )
                sums[name] = values.sum()
            sums["samples"] = jnp.asarray(images.shape[0], jnp.float32)
        if not sums:
            raise ValueError(
                f"validation batch has no sample field {self.inputs.sample.name!r} and the "
                "objective has no eval_metrics; expected one or the other"
            )
        return sums

    def summarize(self, totals: Mapping[str, float]) -> dict[str, float]:
        """``loss`` (mean squared velocity error) and each metric's mean over the samples."""
        out = {}
        if "squared_error" in totals:
            out["loss"] = totals["squared_error"] / max(totals["count"], 1.0)
        for name in sorted(self.eval_metrics):
            out[name] = totals[name] / max(totals["samples"], 1.0)
        return out

    def validate(self, batch: Mapping[str, np.ndarray]) -> None:
        """Check a host batch: the sample and condition fields with their shapes.

        A batch without the sample field passes only when there are ``eval_metrics`` (it
        can then be evaluated; the loss refuses it while tracing).

        Raises:
            ValueError: a missing field or a wrong per-example shape, naming the field.
        """
        if self.inputs.sample.name not in batch and not self.eval_metrics:
            raise ValueError(
                f"batch has no sample field {self.inputs.sample.name!r}; fields are {sorted(batch)}"
            )
        self.inputs.rows(batch)
        self.inputs.condition_fields(batch)

    # ------------------------------------------------------------------ sampling

    def sample(
        self, params: Variables, key: jax.Array, batch: Batch, steps: int | None = None
    ) -> jax.Array:
        """Pixels in ``[-1, 1]`` generated by the probability-flow ODE (Euler, ``steps`` points).

        One sample per row of ``batch`` (the sample field, or the condition fields of a
        prompt-only batch such as ``inputs.tokenize(prompts)``); the live ``params`` are used.
        """
        steps = self.steps if steps is None else check_int("steps", steps, minimum=2)
        rows = self.inputs.rows(batch)
        conditions = self.inputs.condition_fields(batch)
        times = jnp.asarray(self.process.timesteps(steps), jnp.float32)
        cond = self.condition(params, conditions)
        x = jax.random.normal(key, (rows, *self.latent_shape), jnp.float32)

        def euler(x: jax.Array, k: jax.Array) -> tuple[jax.Array, None]:
            t, s = times[k], times[k + 1]
            v = self.velocity(params, x, jnp.full((rows,), t), cond)
            return x - (t - s) * v, None

        x, _ = jax.lax.scan(euler, x, jnp.arange(steps - 1))
        return self.decode(x)
