"""Direct preference optimization: learn from a chosen and a rejected answer per prompt.

Batch layout (from :class:`dew_pipe.data.PreferencePairs`; ``S = seq_len + 1``):

* ``input_ids`` int ``[B, 2, S]``: axis 1 is (chosen, rejected); each row is the prompt
  followed by that answer, right-padded.
* ``completion_mask`` int ``[B, 2, S]``: 1 on answer tokens, 0 on prompt and padding.

Input position ``i`` predicts token ``i + 1``, and the mask of that *target* decides whether
the prediction counts, so each side's score is the sum of its answer tokens' log-probabilities
(position 0 is never scored). With ``pi`` the policy and ``ref`` the frozen reference, the
per-pair loss is ``-log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))``, averaged over the
pairs (TRL's ``sigmoid`` loss; ``tests/test_dpo.py`` checks loss and gradients against TRL).

The reference is the starting policy, kept by the Trainer in ``TrainState.ema`` with the decay
fixed at 1, so it never moves. It is a second parameter tree, not a second model: per step the
policy runs one forward pass over the ``2B`` sequences (chosen and rejected rows together) and
the reference one more, without gradient. Budget memory for that tree as for the policy's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dew_pipe.objectives.lm import LMObjective, summarize_nll
from dew_pipe.training.objective import Variables

__all__ = ["DPOObjective", "sequence_log_probs"]

_FIELDS = ("input_ids", "completion_mask")


def sequence_log_probs(
    model: Any, params: Variables, input_ids: jax.Array, completion_mask: jax.Array
) -> jax.Array:
    """Summed log-probability of the completion tokens of each row.

    Args:
        model: a decoder, ``model.apply(params, tokens) -> logits [N, S - 1, V]``.
        params: its variables ``{"params": ...}``.
        input_ids: ``[N, S]`` token ids.
        completion_mask: ``[N, S]``; a target ``input_ids[:, i + 1]`` counts when
            ``completion_mask[:, i + 1] > 0``.

    Returns:
        float32 ``[N]``: ``sum_i log p(input_ids[:, i + 1] | input_ids[:, :i + 1])`` over the
        counted targets.

    Example:
        >>> ids = jnp.array([[1, 2, 3]])  # doctest: +SKIP
        >>> sequence_log_probs(model, variables, ids, jnp.array([[0, 1, 1]]))  # doctest: +SKIP
        Array([-4.1...], dtype=float32)
    """
    logits = model.apply(params, input_ids[:, :-1]).astype(jnp.float32)
    log_probs = -optax.softmax_cross_entropy_with_integer_labels(logits, input_ids[:, 1:])
    return jnp.sum(jnp.where(completion_mask[:, 1:] > 0, log_probs, 0.0), axis=-1)


class DPOObjective:
    """The DPO preference loss for a causal decoder, against a frozen copy of its start.

    Args:
        model: a Flax linen decoder (e.g. ``models.build("causal_transformer", ...)``).
        seq_len: scored positions per row, ``S - 1`` for ``PreferencePairs(seq_len=S)``.
        beta: strength of the comparison with the reference (> 0). Small values (0.1, as in
            the DPO paper and TRL) let the policy move further from the reference.
        pretrained: starting variables ``{"params": ...}``; they are the policy's start and
            the frozen reference. ``None`` initializes the model randomly.
        ema_decay: fixed at 1.0 (the reference never moves); any other value is refused.

    Attributes:
        ema_decay: 1.0, which tells the Trainer to keep the starting parameters in
            ``TrainState.ema`` and never update them.

    Raises:
        TypeError: a model without ``init``/``apply``, or a non-number ``beta``.
        ValueError: ``beta <= 0`` or not finite, ``ema_decay`` other than 1.0, ``seq_len``
            below 1 or above the model's ``max_seq_len``, or a ``pretrained`` tree that does
            not fit the model.

    Example:
        >>> objective = DPOObjective(model, seq_len=15, beta=0.1)  # doctest: +SKIP
        >>> state = Trainer(objective, optax.adam(1e-3), key=jax.random.key(0)).fit(
        ...     pairs, steps=10)  # doctest: +SKIP
    """

    def __init__(
        self,
        model: Any,
        seq_len: int,
        beta: float,
        pretrained: Variables | None = None,
        *,
        ema_decay: float = 1.0,
    ) -> None:
        if isinstance(beta, bool) or not isinstance(beta, (int, float, np.floating, np.integer)):
            raise TypeError(f"beta is {type(beta).__name__} {beta!r}; expected a positive float")
        if not (math.isfinite(beta) and beta > 0):
            raise ValueError(f"beta is {beta!r}; expected a finite float > 0")
        if ema_decay != 1.0:
            raise ValueError(
                f"ema_decay is {ema_decay!r}; DPOObjective keeps its reference frozen, so the "
                "decay is fixed at 1.0 (leave ema_decay out)"
            )
        # Composition, not inheritance: the LM objective checks the model, seq_len and the
        # pretrained tree, and owns init; DPO only adds the pair loss on top.
        self._lm = LMObjective(model, seq_len, pretrained=pretrained, ema_decay=None)
        self.model = model
        self.seq_len = self._lm.seq_len
        self.beta = float(beta)
        self.ema_decay = 1.0
        self.pretrained = self._lm.pretrained
        self.vocab_size = self._lm.vocab_size

    # ------------------------------------------------------------------ variables

    def init(self, key: jax.Array) -> Variables:
        """A copy of ``pretrained``, or a random initialization from ``key``."""
        return self._lm.init(key)

    def reference(self, params: Variables) -> Variables:
        """What the frozen reference starts as: the starting policy itself."""
        return params

    # ------------------------------------------------------------------ batches

    def _check_layout(self, batch: Mapping[str, Any]) -> None:
        """Presence and shape checks that need no values (they run under tracing too)."""
        want = (2, self.seq_len + 1)
        for name in _FIELDS:
            if name not in batch:
                raise ValueError(
                    f"batch has no field {name!r}; fields are {sorted(batch)}; expected "
                    "'input_ids' and 'completion_mask' from PreferencePairs"
                )
            shape = tuple(np.shape(batch[name]))
            if len(shape) != 3 or shape[1:] != want:
                raise ValueError(
                    f"batch field {name!r} has shape {shape}; DPOObjective(seq_len="
                    f"{self.seq_len}) expects [B, 2, {self.seq_len + 1}] (PreferencePairs("
                    f"seq_len={self.seq_len + 1}))"
                )
        if np.shape(batch["input_ids"]) != np.shape(batch["completion_mask"]):
            raise ValueError(
                f"batch field 'completion_mask' has shape {np.shape(batch['completion_mask'])}; "
                f"expected the shape of 'input_ids', {np.shape(batch['input_ids'])}"
            )

    def validate(self, batch: Mapping[str, np.ndarray]) -> None:
        """Check a host batch before it reaches a compiled function.

        Raises:
            ValueError: a missing field, a wrong shape or dtype, an id outside the
                vocabulary, or a mask value other than 0/1.
        """
        self._check_layout(batch)
        for name in _FIELDS:
            dtype = np.asarray(batch[name]).dtype
            if dtype.kind not in "iu":
                raise ValueError(f"batch field {name!r} has dtype {dtype}; expected integers")
        ids = np.asarray(batch["input_ids"])
        if ids.size and (ids.min() < 0 or (self.vocab_size and ids.max() >= self.vocab_size)):
            bad = ids.min() if ids.min() < 0 else ids.max()
            raise ValueError(
                f"batch field 'input_ids' holds token id {bad}; expected ids in "
                f"[0, {self.vocab_size or 'vocab_size'})"
            )
        mask = np.asarray(batch["completion_mask"])
        if mask.size and not np.isin(mask, (0, 1)).all():
            bad = mask[~np.isin(mask, (0, 1))][0]
            raise ValueError(
                f"batch field 'completion_mask' holds {bad}; expected 0 (prompt, padding) or "
                "1 (completion)"
            )

    # ------------------------------------------------------------------ scores

    def _pair_log_probs(self, params: Variables, batch: Mapping[str, jax.Array]) -> jax.Array:
        """``[B, 2]`` summed completion log-probs, from one forward pass over ``2B`` rows."""
        ids, mask = batch["input_ids"], batch["completion_mask"]
        pairs, width = ids.shape[0], ids.shape[-1]
        # Row 2b is pair b's chosen side, row 2b + 1 its rejected side: a reshape, no copy,
        # and rows stay next to their pair when the batch axis is split over devices.
        flat = sequence_log_probs(
            self.model, params, ids.reshape(2 * pairs, width), mask.reshape(2 * pairs, width)
        )
        return flat.reshape(pairs, 2)

    def rewards(
        self, params: Variables, reference: Variables, batch: Mapping[str, jax.Array]
    ) -> tuple[jax.Array, jax.Array]:
        """The implicit rewards ``beta * (log pi - log ref)`` of each pair's two sides.

        A pair is won when its chosen reward is strictly greater than its rejected reward;
        an unmoved policy therefore scores zero rewards and no wins.

        Args:
            params: the policy variables.
            reference: the reference variables (``TrainState.ema``).
            batch: ``input_ids`` and ``completion_mask`` ``[B, 2, seq_len + 1]``.

        Returns:
            ``(chosen, rejected)``, float32 ``[B]`` each.

        Example:
            >>> chosen, rejected = objective.rewards(state.params, state.ema, batch)  # doctest: +SKIP
            >>> float(jnp.mean(chosen > rejected))  # held-out preference accuracy  # doctest: +SKIP
        """
        self._check_layout(batch)
        policy = self._pair_log_probs(params, batch)
        ref = jax.lax.stop_gradient(self._pair_log_probs(reference, batch))
        ratio = self.beta * (policy - ref)
        return ratio[:, 0], ratio[:, 1]

    # ------------------------------------------------------------------ protocol

    def loss(
        self,
        params: Variables,
        batch: Mapping[str, jax.Array],
        key: jax.Array,
        ema: Variables | None = None,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Mean ``-log sigmoid(beta * margin)`` over the pairs of ``batch``.

        Args:
            params: the policy variables (differentiated).
            batch: ``input_ids`` and ``completion_mask`` ``[B, 2, seq_len + 1]``.
            key: unused (the loss is deterministic).
            ema: the frozen reference variables; required.

        Returns:
            ``(loss, metrics)`` with ``loss``, ``rewards/chosen`` and ``rewards/rejected``
            (mean ``beta`` times each side's log-ratio), ``rewards/accuracies`` (share of
            pairs whose chosen reward is strictly higher), ``rewards/margins`` (mean chosen
            minus rejected reward), ``logps/chosen`` and ``logps/rejected`` (mean summed
            policy log-probabilities) and ``tokens`` (scored completion tokens, both sides).

        Raises:
            ValueError: at trace time, without ``ema`` or for a batch of the wrong layout.
        """
        del key
        if ema is None:
            raise ValueError(
                "ema is None; DPOObjective needs the frozen reference, which the Trainer keeps "
                "in TrainState.ema (ema_decay is 1.0)"
            )
        self._check_layout(batch)
        policy = self._pair_log_probs(params, batch)
        ref = jax.lax.stop_gradient(self._pair_log_probs(jax.lax.stop_gradient(ema), batch))
        ratios = policy - ref
        margins = ratios[:, 0] - ratios[:, 1]
        loss = -jnp.mean(jax.nn.log_sigmoid(self.beta * margins))
        rewards = jax.lax.stop_gradient(self.beta * ratios)
        chosen, rejected = rewards[:, 0], rewards[:, 1]
        logps = jax.lax.stop_gradient(policy)
        metrics = {
            "loss": loss,
            "rewards/chosen": jnp.mean(chosen),
            "rewards/rejected": jnp.mean(rejected),
            "rewards/accuracies": jnp.mean((chosen > rejected).astype(jnp.float32)),
            "rewards/margins": jnp.mean(chosen - rejected),
            "logps/chosen": jnp.mean(logps[:, 0]),
            "logps/rejected": jnp.mean(logps[:, 1]),
            "tokens": jnp.sum(batch["completion_mask"][:, :, 1:] > 0, dtype=jnp.float32),
            # The loss is a mean over pairs: gradient accumulation weights by pairs.
            "loss_weight": jnp.asarray(margins.shape[0], jnp.float32),
        }
        return loss, metrics

    def evaluate(self, params: Variables, batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        """Sums over the chosen answers of one batch: ``nll`` and ``tokens``.

        Only the chosen side is scored (one forward pass over ``B`` rows); all-padding pairs
        have mask 0 and add nothing.
        """
        self._check_layout(batch)
        ids, mask = batch["input_ids"][:, 0], batch["completion_mask"][:, 0]
        logits = self.model.apply(params, ids[:, :-1]).astype(jnp.float32)
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:])
        counted = mask[:, 1:] > 0
        return {
            "nll": jnp.sum(jnp.where(counted, nll, 0.0)),
            "tokens": jnp.sum(counted, dtype=jnp.float32),
        }

    def summarize(self, totals: Mapping[str, float]) -> dict[str, float]:
        """Mean NLL of the chosen answers, its perplexity ``exp(loss)`` and the token count.

        Raises:
            ValueError: when no chosen completion token was counted.
        """
        return summarize_nll(
            totals,
            counted="chosen completion tokens",
            expected="pairs whose chosen_mask marks at least one answer token after position 0",
        )
