"""PPO with a critic: a policy and a value function trained as one variables tree.

The variables are ``{"policy": <policy variables>, "critic": <critic variables>}``, each a
complete Flax variables mapping of its own module, under the ordinary optimizer: one
gradient, one update. The two losses share no parameters, so the composite's gradient is
the policy loss's on the policy subtree and ``value_coefficient`` times the value loss's on
the critic subtree, which is what verl's separate actor and critic updates compute.

* The policy term is GRPO's packed-row loss (:class:`~dew_pipe.objectives.rl.grpo.
  GRPOObjective` on the policy subtree): the dual-clipped surrogate of
  ``compute_policy_loss_vanilla`` on the batch's ``advantages`` (PPO's whitened GAE ones),
  the optional token TIS cap and the k3 KL term against the frozen reference.
* The value term is verl's ``compute_value_loss`` (:func:`~dew_pipe.objectives.rl.critic.
  value_loss`) of the critic's predictions against ``returns``, clipped around the
  recorded ``old_values``.

Both reduce over the same action ids (token mean over ``response_mask``), which is why
PPO refuses the options that would change the policy term's mass alone: sequence and
geometric masks, an IcePop band, and the session-mean aggregation.

The reference for the KL term (``beta > 0``) is the starting *policy* only:
:meth:`PPOObjective.reference` gives the trainer the policy subtree for its frozen EMA slot,
so the critic costs no reference copy.

Example:
    >>> import jax, numpy as np
    >>> from dew_pipe import models
    >>> from dew_pipe.objectives.rl import Call, Session, ValueHead, pack
    >>> decoder = dict(vocab_size=8, emb_features=16, num_layers=1, num_heads=2,
    ...                mlp_features=32, max_seq_len=8)
    >>> objective = PPOObjective(models.build("causal_transformer", **decoder), seq_len=7,
    ...                          critic=ValueHead(models.build("causal_transformer", **decoder)))
    >>> variables = objective.init(jax.random.key(0))
    >>> sorted(variables)
    ['critic', 'policy']
    >>> call = Call([1, 2], [3, 7], [-0.5, -0.1], "stop", 0)
    >>> batch = pack([Session(0, 0, k, 0, [call], "COMPLETED", reward=1.0) for k in range(2)], 8)
    >>> batch.update(old_values=np.zeros_like(batch["advantages"]),
    ...              returns=np.where(batch["response_mask"] == 1, 1.0, 0.0).astype(np.float32))
    >>> objective.validate(batch)
    >>> loss, metrics = objective.loss(variables, batch, jax.random.key(1))
    >>> float(metrics["value_loss"])   # a zero-initialized head predicts 0 for returns of 1
    0.5
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dew_pipe._validate import check_float
from dew_pipe.objectives.rl.critic import packed_values, value_loss
from dew_pipe.objectives.rl.grpo import GRPOObjective
from dew_pipe.objectives.rl.policy import PolicyOptions
from dew_pipe.training.objective import Variables

__all__ = ["PPOObjective", "PolicySubtree"]

_PPO_COLUMNS = ("old_values", "returns")


class PolicySubtree:
    """A sampling policy that binds to the policy subtree of PPO variables.

    ``bind(snapshot)`` takes the Trainer's state (or a variables tree), picks its
    ``"policy"`` subtree and binds the wrapped policy to it; sampling calls go through
    unchanged. ``EpisodeRollout`` reads ``model`` for its size checks.

    Args:
        policy: a bindable policy over the policy model (``TextGeneration``).
    """

    def __init__(self, policy: Any) -> None:
        self.policy = policy
        self.model = getattr(policy, "model", None)

    def bind(self, snapshot: Any) -> PolicySubtree:
        """Binds the wrapped policy to ``snapshot``'s policy subtree; returns ``self``."""
        self.policy.bind(_policy_subtree(getattr(snapshot, "params", snapshot)))
        return self

    def batch(self, contexts: Any, budget: int, key: jax.Array, sampling: Any) -> Any:
        return self.policy.batch(contexts, budget, key, sampling)

    def __call__(self, context: Any, budget: int, key: jax.Array, sampling: Any) -> Any:
        return self.policy(context, budget, key, sampling)


def _policy_subtree(variables: Any) -> Variables:
    if not isinstance(variables, Mapping) or "policy" not in variables:
        keys = sorted(map(str, variables)) if isinstance(variables, Mapping) else None
        raise ValueError(
            f"variables have keys {keys}; expected PPO variables {{'policy': ..., "
            "'critic': ...}} (PPOObjective.init)"
        )
    return variables["policy"]


class PPOObjective:
    """PPO on packed rows: the clipped policy loss plus a clipped value loss.

    Args:
        model: the policy, a Flax decoder (as for ``GRPOObjective``).
        seq_len: ``W - 1`` for packed rows ``[N, W]``.
        critic: the value function, ``critic.apply(variables, tokens, segment_ids,
            positions) -> [B, S]`` (a :class:`~dew_pipe.objectives.rl.critic.ValueHead` or
            your own module); initialized from its own key, never from the policy.
        value_coefficient: weight of the value loss in the composite (verl's critic and
            TRL's ``vf_coef`` default, 0.5); 0 trains the policy alone.
        value_clip: how far (in the units of the returns) a prediction may move from its
            ``old_values`` before the clipped error takes over (verl ``cliprange_value``);
            None turns the clip off.
        beta: coefficient of the k3 KL penalty against the frozen starting policy.
        pretrained: starting variables of the policy (``{"params": ...}``), copied at init.
        epsilon_low, epsilon_high, dual_clip: the policy ratio's clip (as in GRPO).
        behavior_importance: None, or a TIS cap ``c > 0`` weighting each token by
            ``min(pi_old / mu, c)``. An IcePop band is refused (its bypass form removes
            tokens from the policy term only).
        sampling_temperature: score the policy's ids at this temperature (as in GRPO).
        kl_estimator: the reference KL estimator (as in GRPO).
        aggregation, sequence_mask, geometric_mask: accepted only at their defaults
            ("token-mean", None, None): both losses must reduce over the same action ids.
        response_columns: score only each row's sampled ids in the policy loss (as in GRPO).

    Raises:
        TypeError: a model or critic without ``init``/``apply``.
        ValueError: an option out of range or refused, naming it; ``seq_len`` beyond the
            policy's or the critic's ``max_seq_len``.
    """

    def __init__(
        self,
        model: Any,
        seq_len: int,
        critic: Any,
        value_coefficient: float = 0.5,
        value_clip: float | None = 0.2,
        beta: float = 0.0,
        pretrained: Variables | None = None,
        epsilon_low: float = 0.2,
        epsilon_high: float = 0.2,
        dual_clip: float | None = 3.0,
        behavior_importance: float | None = None,
        sampling_temperature: float | None = None,
        *,
        kl_estimator: str = "k3",
        aggregation: str = "token-mean",
        sequence_mask: tuple[float, float] | None = None,
        geometric_mask: tuple[float, float] | None = None,
        response_columns: int | None = None,
    ) -> None:
        if not (
            callable(getattr(critic, "init", None)) and callable(getattr(critic, "apply", None))
        ):
            raise TypeError(
                f"critic is a {type(critic).__name__}; expected a Flax module returning one "
                "value per position (ValueHead(backbone))"
            )
        refused = {
            "aggregation": (aggregation, "token-mean"),
            "sequence_mask": (sequence_mask, None),
            "geometric_mask": (geometric_mask, None),
        }
        for name, (value, default) in refused.items():
            if value != default:
                raise ValueError(
                    f"{name}: {value!r}; PPO keeps {name}={default!r}, since the policy and "
                    "value losses must reduce over the same action ids (token mean)"
                )
        if isinstance(behavior_importance, tuple | list):
            raise ValueError(
                f"behavior_importance: {behavior_importance!r}; PPO takes a TIS cap (a number "
                "> 0) or None, not an IcePop band, which would drop tokens from the policy "
                "term only"
            )
        self.actor = GRPOObjective(
            model,
            seq_len,
            beta=beta,
            pretrained=pretrained,
            epsilon_low=epsilon_low,
            epsilon_high=epsilon_high,
            dual_clip=dual_clip,
            behavior_importance=behavior_importance,
            sampling_temperature=sampling_temperature,
            kl_estimator=kl_estimator,
            response_columns=response_columns,
        )
        self.model, self.critic = model, critic
        self.seq_len = self.actor.seq_len
        self.beta = self.actor.beta
        self.value_coefficient = check_float("value_coefficient", value_coefficient, minimum=0.0)
        self.value_clip = check_float("value_clip", value_clip, above=0.0, allow_none=True)
        config = getattr(critic, "config", None) or getattr(
            getattr(critic, "backbone", None), "config", None
        )
        longest = getattr(config, "max_seq_len", None)
        if isinstance(longest, int) and self.seq_len > longest:
            raise ValueError(f"seq_len={self.seq_len} exceeds the critic's max_seq_len={longest}")

    @property
    def options(self) -> PolicyOptions:
        """The policy term's options (GRPO's)."""
        return self.actor.options

    @property
    def proximal_in_step(self) -> bool:
        """False: PPO trains on the ``old_log_probs`` its batch records (several epochs of
        updates on one batch need them)."""
        return False

    @property
    def ema_decay(self) -> float | None:
        """1.0 (the frozen starting policy in the EMA slot) when ``beta > 0``, else None."""
        return self.actor.ema_decay

    # ------------------------------------------------------------------ variables

    def init(self, key: jax.Array) -> Variables:
        """``{"policy": ..., "critic": ...}``, each initialized from its own half of ``key``
        (the policy as a copy of ``pretrained`` when given)."""
        policy_key, critic_key = jax.random.split(key)
        example = jnp.zeros((1, self.seq_len), jnp.int32)
        critic = self.critic.init(critic_key, example, jnp.ones_like(example), _arange(example))
        return {"policy": self.actor.init(policy_key), "critic": critic}

    def reference(self, params: Variables) -> Variables:
        """What the EMA slot starts from: the policy subtree only."""
        return _policy_subtree(params)

    def policy_variables(self, variables: Variables) -> Variables:
        """The policy subtree of ``variables`` (what a rollout server serves)."""
        return _policy_subtree(variables)

    def policy(self, variables: Variables, **options: Any) -> PolicySubtree:
        """A sampling policy over the policy model, bound to ``variables``' policy subtree.

        Pass it to ``EpisodeRollout``: each collection binds it to the Trainer's state,
        whose policy subtree it picks out. ``options`` go to
        ``dew_pipe.inference.TextGeneration`` (``buckets``, ``record_support``, ``pad_id``).
        """
        from dew_pipe.inference.text import TextGeneration  # sampling lives a module over

        return PolicySubtree(TextGeneration(self.model, _policy_subtree(variables), **options))

    # ------------------------------------------------------------------ scoring

    def values(self, params: Variables, batch: Mapping[str, jax.Array]) -> jax.Array:
        """The critic's value before every id of packed rows, ``[N, W]`` float32 (0 where
        an id starts its chain or is padding); what a rollout records as ``old_values``."""
        return packed_values(self.critic, params["critic"], batch)

    def packed_log_probs(self, params: Variables, batch: Mapping[str, jax.Array]) -> jax.Array:
        """The policy's log-probability of every id given its chain's prefix, ``[N, W]``
        (``GRPOObjective.packed_log_probs`` on the policy subtree)."""
        return self.actor.packed_log_probs(_policy_subtree(params), batch)

    # ------------------------------------------------------------------ protocol

    def loss(
        self,
        params: Variables,
        batch: Mapping[str, jax.Array],
        key: jax.Array,
        ema: Variables | None = None,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """``pg_loss + beta * kl_loss + value_coefficient * value_loss`` of one batch.

        Returns:
            ``(loss, metrics)``: GRPO's metrics (``pg_loss``, ``kl_loss``, ``tokens``,
            ``pg_clipfrac``, ...) plus ``value_loss``, ``value_clipfrac``, ``value_error``
            (mean squared error of the predictions against the returns, unclipped),
            ``values`` (their mean), ``returns`` (the targets' mean) and ``trainable`` (0
            when the batch has no action id: the Trainer then makes no update).

        Raises:
            ValueError: at trace time, a missing column or wrong shape (the PPO columns
                ``old_values`` and ``returns`` included), or ``beta > 0`` without ``ema``.
        """
        self._check_columns(batch)
        policy_loss, metrics = self.actor.loss(_policy_subtree(params), batch, key, ema)
        predicted = self.values(params, batch)
        mask = batch["response_mask"].astype(jnp.float32)
        critic_loss, clipfrac = value_loss(
            predicted, batch["returns"], batch["old_values"], mask, clip=self.value_clip
        )
        total = policy_loss + self.value_coefficient * critic_loss
        returns = jnp.asarray(batch["returns"], jnp.float32)
        tokens = jnp.sum(mask)
        metrics.update(
            loss=jax.lax.stop_gradient(total),
            value_loss=jax.lax.stop_gradient(critic_loss),
            value_clipfrac=jax.lax.stop_gradient(clipfrac),
            value_error=jax.lax.stop_gradient(
                _masked_mean(jnp.square(predicted - returns), mask, tokens)
            ),
            values=jax.lax.stop_gradient(_masked_mean(predicted, mask, tokens)),
            returns=_masked_mean(returns, mask, tokens),
            trainable=(tokens > 0).astype(jnp.float32),
        )
        return total, metrics

    def _check_columns(self, batch: Mapping[str, Any]) -> None:
        shape = tuple(np.shape(batch["input_ids"])) if "input_ids" in batch else None
        for name in _PPO_COLUMNS:
            if name not in batch:
                raise ValueError(
                    f"batch has no field {name!r}; PPOObjective trains the targets PPORollout "
                    f"prepares (old_values, advantages, returns) (fields are {sorted(batch)})"
                )
            if shape is not None and tuple(np.shape(batch[name])) != shape:
                raise ValueError(
                    f"batch field {name!r} has shape {tuple(np.shape(batch[name]))}; expected "
                    f"it aligned with input_ids, {shape}"
                )

    def evaluate(self, params: Variables, batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        """The policy's prompt perplexity sums (``GRPOObjective.evaluate``)."""
        return self.actor.evaluate(_policy_subtree(params), batch)

    def summarize(self, totals: Mapping[str, float]) -> dict[str, float]:
        """Mean prompt NLL, perplexity and tokens (``GRPOObjective.summarize``)."""
        return self.actor.summarize(totals)

    def validate(self, batch: Mapping[str, np.ndarray]) -> None:
        """GRPO's host checks of the batch, and the PPO columns: present, aligned with
        ``input_ids``, float, finite on the trainable ids.

        Raises:
            ValueError: naming the field, the value or shape, and what was expected.
        """
        self.actor.validate(batch)
        if "input_ids" not in batch:
            return
        self._check_columns(batch)
        trainable = np.asarray(batch["response_mask"]) == 1
        for name in _PPO_COLUMNS:
            array = np.asarray(batch[name])
            if array.dtype.kind != "f":
                raise ValueError(f"batch field {name!r} has dtype {array.dtype}; expected floats")
            bad = trainable & ~np.isfinite(array)
            if bad.any():
                row, column = np.argwhere(bad)[0]
                raise ValueError(
                    f"batch field {name!r} is {array[row, column]} at row {row}, column "
                    f"{column}, a trainable id; expected a finite number"
                )


def _arange(example: jax.Array) -> jax.Array:
    return jnp.broadcast_to(jnp.arange(example.shape[1], dtype=jnp.int32), example.shape)


def _masked_mean(values: jax.Array, mask: jax.Array, count: jax.Array) -> jax.Array:
    return jnp.sum(jnp.where(mask != 0, values * mask, 0.0)) / jnp.maximum(count, 1.0)
