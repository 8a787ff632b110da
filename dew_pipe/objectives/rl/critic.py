"""The critic side of PPO: a value head, packed-row values and the clipped value loss.

A critic maps packed token ids to one scalar per position: ``critic.apply(variables,
tokens, segment_ids, positions) -> [B, S]``, the value of the state that has read the ids
up to and including that position. :class:`ValueHead` builds one from any decoder with a
``features`` method (a scalar Dense head on its hidden states); a custom Flax module with
the same call form works as well.

:func:`packed_values` aligns those outputs with packed rows the way the policy's
log-probabilities are aligned: column ``c`` of ``[N, W]`` gets the value the critic
computed at ``c - 1``, the state *before* id ``c`` was drawn (verl's
``values[:, -response_length - 1 : -1]``), and 0 where ``c`` starts its chain or is padding.

:func:`value_loss` is verl's ``compute_value_loss``: predictions clipped to
``old_values +- clip``, the larger of the two squared errors per token, half of its
token mean over the response mask.

Example:
    >>> import jax, jax.numpy as jnp
    >>> loss, clipfrac = value_loss(jnp.array([[1.0, 0.0]]), jnp.array([[0.0, 0.0]]),
    ...                             jnp.array([[0.5, 0.0]]), jnp.ones((1, 2)), clip=0.2)
    >>> float(loss), float(clipfrac)   # 0.5 * mean(max(1, 0.49), 0)
    (0.25, 0.0)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from dew_pipe.objectives.rl import losses as L

__all__ = ["ValueHead", "packed_values", "value_loss"]


class ValueHead(nn.Module):
    """A critic: a scalar Dense head on a backbone's hidden states.

    Attributes:
        backbone: a Flax module with ``features(tokens, segment_ids, positions) ->
            [B, S, D]`` (the decoder of ``models.build("causal_transformer", ...)``); one
            without ``features`` is called directly and must return ``[B, S, D]``. It is a
            submodule of the head, so its parameters are the critic's own, initialized
            when the critic is, never shared with the policy.
        kernel_init: initializer of the head's ``[D, 1]`` kernel. Zeros by default: the
            critic starts by predicting 0 everywhere, so the first advantages are the
            discounted rewards rather than noise from a random head.

    Returns (when applied):
        ``[B, S]`` float32 values.

    Example:
        >>> from dew_pipe import models
        >>> decoder = models.build("causal_transformer", vocab_size=8, emb_features=16,
        ...                        num_layers=1, num_heads=2, mlp_features=32, max_seq_len=8)
        >>> head = ValueHead(decoder)
        >>> ids = jnp.zeros((2, 5), jnp.int32)
        >>> variables = head.init(jax.random.key(0), ids)
        >>> head.apply(variables, ids).shape, sorted(variables["params"])
        ((2, 5), ['backbone', 'head'])
    """

    backbone: nn.Module
    kernel_init: Callable[..., jax.Array] = nn.initializers.zeros_init()

    @nn.compact
    def __call__(
        self,
        tokens: jax.Array,
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
    ) -> jax.Array:
        features = getattr(self.backbone, "features", None)
        if callable(features):
            hidden = features(tokens, segment_ids, positions)
        else:
            hidden = self.backbone(tokens, segment_ids, positions)
        if jnp.ndim(hidden) != 3:
            raise ValueError(
                f"backbone features have shape {jnp.shape(hidden)}; expected [B, S, D]"
            )
        head = nn.Dense(1, kernel_init=self.kernel_init, dtype=jnp.float32, name="head")
        return head(jnp.asarray(hidden, jnp.float32))[..., 0]


def packed_values(
    critic: Any, variables: Mapping[str, Any], batch: Mapping[str, jax.Array]
) -> jax.Array:
    """The critic's value before each id of packed rows, ``[N, W]`` float32.

    Args:
        critic: the critic module (``critic.apply(variables, tokens, segment_ids,
            positions) -> [N, W - 1]``).
        variables: its variables.
        batch: packed rows with ``input_ids``, ``text_segment_ids``, ``text_positions``.

    Returns:
        Column ``c`` holds the critic's output at ``c - 1`` where ``c`` continues a chain,
        0 where it starts one or is padding.

    Raises:
        ValueError: (at trace time) a critic output that is not ``[N, W - 1]``.
    """
    if "text_prefix_segments" in batch:
        raise ValueError(
            "batch has 'text_prefix_segments' (rows packed with share_prompts=True); the "
            "critic reads each chain whole, so pack PPO batches with share_prompts=False"
        )
    ids, segments = batch["input_ids"], batch["text_segment_ids"]
    positions = batch["text_positions"]
    out = critic.apply(variables, ids[:, :-1], segments[:, :-1], positions[:, :-1])
    expected = (ids.shape[0], ids.shape[1] - 1)
    if tuple(jnp.shape(out)) != expected:
        raise ValueError(
            f"the critic returned shape {tuple(jnp.shape(out))}; expected one value per "
            f"position, {expected}"
        )
    out = jnp.asarray(out, jnp.float32)
    continues = (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] > 0)
    pad = jnp.zeros((ids.shape[0], 1), jnp.float32)
    return jnp.concatenate([pad, jnp.where(continues, out, 0.0)], axis=1)


def value_loss(
    values: jax.Array,
    returns: jax.Array,
    old_values: jax.Array,
    mask: jax.Array,
    *,
    clip: float | None,
) -> tuple[jax.Array, jax.Array]:
    """Clipped value loss (verl ``compute_value_loss``, token-mean).

    Args:
        values: current critic predictions (differentiated).
        returns: the value targets.
        old_values: the predictions recorded at rollout time; the clip is centred on them.
        mask: 1.0 on the tokens that count.
        clip: ``cliprange_value``; None turns the clip off (the plain squared error).

    Returns:
        ``(loss, clipfrac)``: ``0.5 * token_mean(max((v - R)^2, (clip(v) - R)^2))`` and
        the share of tokens where the clipped error was the larger.
    """
    returns = jax.lax.stop_gradient(returns.astype(values.dtype))
    old_values = jax.lax.stop_gradient(old_values.astype(values.dtype))
    mask = mask.astype(values.dtype)
    plain = jnp.square(values - returns)
    if clip is None:
        return 0.5 * L.aggregate(plain, mask, "token-mean"), jnp.zeros((), values.dtype)
    clipped = jnp.clip(values, old_values - clip, old_values + clip)
    bounded = jnp.square(clipped - returns)
    loss = 0.5 * L.aggregate(jnp.maximum(plain, bounded), mask, "token-mean")
    return loss, L.masked_mean((bounded > plain).astype(values.dtype), mask)
