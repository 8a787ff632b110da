"""FlowGRPOObjective: Flow-GRPO (Liu et al. 2025) on a rectified-flow model's own samples.

The rollout (`~dew_pipe.inference.flow_rollout.FlowRollout`) samples SDE paths with
`~dew_pipe.inference.flow_sampling.sample_trajectory`, scores the samples and hands over,
for each of ``N`` samples and ``T`` selected stochastic transitions ``x_t -> x_s``
(``h = t - s``), the batch described in `FlowGRPOObjective.validate`. The loss follows the
paper's objective (section 4), negated for minimisation:

    mu_theta   = transition mean of the SDE step from x_t under v_theta      (diffusion.py)
    std        = sigma_t sqrt(h)
    log p      = (1 / D) * log N(x_s; mu_theta, std^2 I)      per-coordinate log density
    r          = exp(log p - old_log_probs)
    policy     = max(-A r, -A clip(r, 1 - eps, 1 + eps))
    kl         = transition_kl(mu_theta, mu_ref, std) = mean_i (mu_theta,i - mu_ref,i)^2 / (2 std^2)
    loss       = sum_{n,j} m_nj (policy_nj + beta kl_nj) / sum_{n,j} m_nj

``A`` is the row's group-normalised advantage, ``m`` the transition mask (zero for the
transitions of a zero-advantage row and for padding), ``D`` the latent's coordinate count
and ``mu_ref`` the frozen starting policy's mean. With ``beta > 0`` that policy lives in the
Trainer's EMA slot (``ema_decay = 1``: copied at initialisation and never moved); with
``beta = 0`` no reference is kept and the KL term is not computed.

Evaluation (``evaluate``/``summarize``) and previews (``sample``) use the live policy and
the objective's own ``steps`` with the diffusion objective's sampler.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dew_pipe._validate import check_float
from dew_pipe.diffusion import (
    Process,
    transition_kl,
    transition_log_density,
    transition_mean,
)
from dew_pipe.inputs import InputSpec
from dew_pipe.objectives.diffusion import DiffusionObjective
from dew_pipe.training.objective import Batch, Metrics, Variables

__all__ = ["FlowGRPOObjective", "transition_kl"]

#: Per-transition fields of a Flow-GRPO batch, each ``[N, T]`` (states add the latent shape).
TRANSITION_FIELDS = ("times", "next_times", "sigmas", "old_log_probs", "transition_mask")


class FlowGRPOObjective:
    """Flow-GRPO's clipped policy loss over selected stochastic transitions.

    Args:
        model: the velocity model (e.g. `dew_pipe.models.SimpleDiT`).
        process: a rectified-flow `~dew_pipe.diffusion.Process` with velocity prediction.
        inputs: the `~dew_pipe.inputs.InputSpec` (sample field first, then conditions).
        guidance: ``None`` or the classifier-free guidance scale used for sampling and
            for the policy's transition means alike.
        beta: KL coefficient against the frozen starting policy (0: no reference kept).
        steps: time points of evaluation and previews (``sample``), both ends included.
        clip: ``eps`` of the ratio clip; 1e-4, the released Flow-GRPO setting, since the
            per-coordinate ratio moves very little.
        encoders: the condition encoders (see `DiffusionObjective`).
        autoencoder: an optional frozen autoencoder (see `DiffusionObjective`).
        eval_metrics: the metric consumers of evaluation (see `DiffusionObjective`).
        pretrained: starting variables, e.g. a flow-matching run's final ``state.params``
            (see `DiffusionObjective`); with ``beta > 0`` they are also the reference.

    Attributes:
        diffusion: the `DiffusionObjective` holding the inputs, encoders, autoencoder and
            process; `sample_trajectory` and `FlowRollout` sample through it.

    Raises:
        TypeError, ValueError: as `DiffusionObjective`, and for a negative ``beta`` or a
            ``clip`` outside (0, 1).

    Example:
        >>> from dew_pipe import Field, InputSpec, models, presets
        >>> model = models.SimpleDiT(output_channels=1, patch_size=2, emb_features=8,
        ...                          num_layers=1, num_heads=2, mlp_ratio=2)
        >>> objective = FlowGRPOObjective(model, presets.Flow()(), InputSpec(Field("image", (4, 4, 1))),
        ...                               guidance=None, beta=0.01, steps=5)
        >>> objective.ema_decay
        1.0
    """

    def __init__(
        self,
        model: Any,
        process: Process,
        inputs: InputSpec,
        guidance: float | None = None,
        beta: float = 0.0,
        steps: int = 10,
        *,
        clip: float = 1e-4,
        encoders: Mapping[str, Any] | None = None,
        autoencoder: Any = None,
        eval_metrics: Mapping[str, Callable[[jax.Array, Batch], jax.Array]] | None = None,
        pretrained: Variables | None = None,
    ) -> None:
        self.diffusion = DiffusionObjective(
            model,
            process,
            inputs,
            encoders=encoders,
            autoencoder=autoencoder,
            guidance=guidance,
            steps=steps,
            eval_metrics=eval_metrics,
            pretrained=pretrained,
        )
        self.beta = check_float("beta", beta, minimum=0.0)
        self.clip = check_float("clip", clip, above=0.0, below=1.0)

    # The parts a caller reads, held by the diffusion objective.
    model = property(lambda self: self.diffusion.model)
    process = property(lambda self: self.diffusion.process)
    inputs = property(lambda self: self.diffusion.inputs)
    steps = property(lambda self: self.diffusion.steps)

    @property
    def ema_decay(self) -> float | None:
        """1.0 (the frozen starting policy in the EMA slot) when ``beta > 0``, else None."""
        return 1.0 if self.beta > 0 else None

    def init(self, key: jax.Array) -> Variables:
        """``pretrained`` copied, or fresh variables (`DiffusionObjective.init`)."""
        return self.diffusion.init(key)

    def reference(self, params: Variables) -> Variables:
        """The EMA slot starts as the starting policy itself."""
        return params

    # ------------------------------------------------------------------ the loss

    def transition_means(self, params: Variables, batch: Batch) -> jax.Array:
        """Means ``[N * T, *latent]`` of the selected transitions under ``params``."""
        diffusion = self.diffusion
        states = batch["states"]
        rows, transitions = states.shape[:2]
        x = states.reshape(rows * transitions, *states.shape[2:])
        t = batch["times"].reshape(-1)
        h = t - batch["next_times"].reshape(-1)
        conditions = {f.name: batch[f.name] for f in diffusion.inputs.conditions}
        cond = diffusion.condition(params, conditions)
        if cond is not None:
            cond = jnp.repeat(cond, transitions, axis=0)  # row n's transitions share its cond
        velocity = diffusion.velocity(params, x, t, cond)
        return transition_mean(x, velocity, t, h, batch["sigmas"].reshape(-1))

    def loss(
        self, params: Variables, batch: Batch, key: jax.Array, ema: Variables | None
    ) -> tuple[jax.Array, Metrics]:
        """Flow-GRPO loss (module docstring) and its diagnostics.

        Metrics: ``loss``, ``policy_loss``, ``kl`` (with ``beta > 0``), ``ratio``,
        ``clip_fraction``, ``transitions`` (trained), ``loss_weight`` (the same count, for
        accumulation) and ``reward`` (a float32 mean of the batch's rewards, when present).
        """
        if self.beta > 0 and ema is None:
            raise ValueError(
                "beta > 0 needs the frozen starting policy; the Trainer passes it from the "
                "EMA slot (ema_decay is 1.0)"
            )
        rows, transitions = batch["states"].shape[:2]
        mean = self.transition_means(params, batch)
        sigma = batch["sigmas"].reshape(-1)
        std = sigma * jnp.sqrt(batch["times"].reshape(-1) - batch["next_times"].reshape(-1))
        std = jnp.where(std > 0, std, 1.0)  # masked padding only: stochastic steps have std > 0
        following = batch["next_states"].reshape(mean.shape)
        log_prob = transition_log_density(following, mean, std) / self.diffusion.coordinates
        log_prob = log_prob.reshape(rows, transitions)
        mask = batch["transition_mask"].astype(jnp.float32)
        advantages = batch["advantages"].astype(jnp.float32)[:, None]
        ratio = jnp.exp(log_prob - batch["old_log_probs"])
        clipped = jnp.clip(ratio, 1.0 - self.clip, 1.0 + self.clip)
        policy = jnp.maximum(-advantages * ratio, -advantages * clipped)
        count = mask.sum()
        scale = 1.0 / jnp.maximum(count, 1.0)
        per = policy
        metrics: dict[str, jax.Array] = {}
        if self.beta > 0:
            reference = jax.lax.stop_gradient(self.transition_means(ema, batch))
            kl = transition_kl(mean, reference, std).reshape(rows, transitions)
            per = per + self.beta * kl
            metrics["kl"] = (kl * mask).sum() * scale
        loss = (per * mask).sum() * scale
        metrics.update(
            loss=loss,
            policy_loss=(policy * mask).sum() * scale,
            ratio=(ratio * mask).sum() * scale,
            clip_fraction=((jnp.abs(ratio - 1.0) > self.clip) * mask).sum() * scale,
            transitions=count,
            loss_weight=count,
        )
        if "rewards" in batch:
            metrics["reward"] = batch["rewards"].astype(jnp.float32).mean()
        return loss, metrics

    # ------------------------------------------------------------------ evaluation

    def evaluate(self, params: Variables, batch: Batch) -> Metrics:
        """Evaluation sums of the live policy (`DiffusionObjective.evaluate`)."""
        return self.diffusion.evaluate(params, batch)

    def summarize(self, totals: Mapping[str, float]) -> dict[str, float]:
        return self.diffusion.summarize(totals)

    def sample(
        self, params: Variables, key: jax.Array, batch: Batch, steps: int | None = None
    ) -> jax.Array:
        """Preview samples of the live policy (`DiffusionObjective.sample`)."""
        return self.diffusion.sample(params, key, batch, steps)

    # ------------------------------------------------------------------ checks

    def validate(self, batch: Mapping[str, np.ndarray]) -> None:
        """Check a rollout batch on the host before any compile.

        A Flow-GRPO batch holds ``states`` and ``next_states`` ``[N, T, *latent]``,
        ``times``, ``next_times``, ``sigmas``, ``old_log_probs`` and ``transition_mask``
        ``[N, T]``, ``advantages [N]``, optionally ``rewards [N]``, and the condition fields.
        A batch with the sample field and no ``states`` is a validation batch.

        Raises:
            ValueError: a missing field, a misshapen one, a mask that is not 0/1, or a
                masked-in transition with no positive noise (a deterministic step).
        """
        if "states" not in batch:
            self.diffusion.validate(batch)
            return
        latent = self.diffusion.latent_shape
        states = np.shape(batch["states"])
        if len(states) != 2 + len(latent) or tuple(states[2:]) != latent:
            raise ValueError(
                f"batch field 'states' has shape {states}; expected (N, T, "
                f"{', '.join(map(str, latent))})"
            )
        rows, transitions = states[:2]
        expected = {
            "next_states": tuple(states),
            **{name: (rows, transitions) for name in TRANSITION_FIELDS},
            "advantages": (rows,),
        }
        if "rewards" in batch:
            expected["rewards"] = (rows,)
        for name, shape in expected.items():
            if name not in batch:
                raise ValueError(
                    f"Flow-GRPO batch has no field {name!r}; fields are {sorted(batch)}"
                )
            if np.shape(batch[name]) != shape:
                raise ValueError(
                    f"batch field {name!r} has shape {np.shape(batch[name])}; expected {shape}"
                )
        self.inputs.condition_fields(batch)
        mask = np.asarray(batch["transition_mask"])
        if not np.isin(mask, (0, 1)).all():
            raise ValueError(
                f"batch field 'transition_mask' holds {np.unique(mask)[:5].tolist()}; "
                "expected only 0 and 1"
            )
        h = np.asarray(batch["times"]) - np.asarray(batch["next_times"])
        std = np.asarray(batch["sigmas"]) * np.sqrt(np.maximum(h, 0.0))
        bad = np.argwhere((mask == 1) & ~(std > 0))
        if len(bad):
            row, step = bad[0]
            raise ValueError(
                f"transition {step} of row {row} is masked in but has no noise (sigma "
                f"{np.asarray(batch['sigmas'])[row, step]}, elapsed {h[row, step]}); expected "
                "only stochastic transitions in the loss (a deterministic step has no density)"
            )
