"""Next-token prediction: the language-model objective used for pretraining and SFT.

Batch layout (``L = seq_len``; all arrays ``[B, L + 1]``):

* ``text`` (int): token ids, one more than the predicted length.
* ``text_segment_ids`` (int, optional): document id per token, 0 = padding. Absent
  means one document per row, all tokens real.
* ``text_positions`` (int, optional): position inside each document, passed to the
  model. Absent means the model's default (``arange``).
* ``text_roles`` (int, optional; int8 from ChatMessages): the role of each token
  (:class:`dew_pipe.data.chat.Role`). Required when ``loss_role`` is set.

Input position ``i`` (ids ``text[:, :L]``) predicts target ``text[:, i + 1]``. A
target counts toward the loss when it is not padding (segment > 0), belongs to the
same document as its input (no prediction across a packing boundary), and, with
``loss_role``, has that role. The loss is the mean negative log-likelihood over the
counted targets; the ``tokens`` metric is their number.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dew_pipe.training.objective import Variables, check_shapes, check_variables

__all__ = ["LMObjective", "summarize_nll", "target_mask"]

_OPTIONAL = ("text_roles", "text_segment_ids", "text_positions")


def target_mask(
    segment_ids: Any | None, roles: Any | None, loss_role: int | None, shape: tuple[int, int]
) -> Any:
    """Which next-token targets count, as a ``[B, L]`` bool array.

    Works on NumPy and JAX arrays alike (the same rule backs the loss and the tests).

    Args:
        segment_ids: ``[B, L + 1]`` document ids (0 = padding) or ``None``.
        roles: ``[B, L + 1]`` token roles or ``None``.
        loss_role: count only targets whose role equals this, or ``None`` for all.
        shape: ``(B, L)`` for the all-true mask when nothing restricts it.

    Example:
        >>> target_mask(np.array([[1, 1, 2, 0]]), None, None, (1, 3)).tolist()
        [[True, False, False]]
    """
    xp = jnp if isinstance(segment_ids, jax.Array) or isinstance(roles, jax.Array) else np
    mask = xp.ones(shape, dtype=bool)
    if segment_ids is not None:
        inputs, targets = segment_ids[:, :-1], segment_ids[:, 1:]
        mask = mask & (targets > 0) & (targets == inputs)
    if loss_role is not None:
        mask = mask & (roles[:, 1:] == loss_role)
    return mask


class LMObjective:
    """Next-token cross-entropy for a causal decoder.

    Args:
        model: a Flax linen decoder, ``model.apply(variables, tokens, segment_ids=...,
            positions=...) -> logits [B, S, V]`` (e.g. ``models.build("causal_transformer",
            ...)``).
        seq_len: predicted positions per row, ``L``; batches carry ``L + 1`` ids.
        pretrained: starting variables ``{"params": ...}`` (copied at init); ``None``
            initializes the model randomly.
        loss_role: count only targets with this role (e.g. ``Role.ASSISTANT``); then
            every batch needs ``text_roles``.
        ema_decay: the trainer's moving-average decay. 0.999 averages over roughly the
            last thousand updates (``1 / (1 - decay)``), a span that smooths update
            noise over a typical fine-tuning run without lagging far behind it;
            ``None`` keeps no averaged copy (saves one parameter tree of memory).

    Raises:
        TypeError: for a model without ``init``/``apply`` or a non-int setting.
        ValueError: for ``seq_len`` below 1 or above the model's ``max_seq_len``, a
            ``pretrained`` tree that does not match the model (naming the leaf),
            or ``ema_decay`` outside ``[0, 1]``.

    Example:
        >>> objective = LMObjective(model, seq_len=16, loss_role=Role.ASSISTANT)  # doctest: +SKIP
        >>> objective.validate({"text": np.zeros((8, 17), np.int32)})  # doctest: +SKIP
        Traceback (most recent call last):
        ValueError: batch has no field 'text_roles'; ...
    """

    def __init__(
        self,
        model: Any,
        seq_len: int,
        pretrained: Variables | None = None,
        loss_role: int | None = None,
        ema_decay: float | None = 0.999,
    ) -> None:
        if not (callable(getattr(model, "init", None)) and callable(getattr(model, "apply", None))):
            raise TypeError(f"model is a {type(model).__name__}; expected a Flax linen Module")
        if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
            raise ValueError(f"seq_len={seq_len!r}; expected an int >= 1")
        config = getattr(model, "config", None)
        max_len = getattr(config, "max_seq_len", None)
        if max_len is not None and seq_len > max_len:
            raise ValueError(
                f"seq_len={seq_len} exceeds the model's max_seq_len={max_len}; "
                f"expected seq_len <= {max_len}"
            )
        if loss_role is not None and (
            isinstance(loss_role, bool) or not isinstance(loss_role, (int, np.integer))
        ):
            raise TypeError(
                f"loss_role={loss_role!r}; expected None or an int role such as Role.ASSISTANT"
            )
        if ema_decay is not None and (
            isinstance(ema_decay, bool)
            or not isinstance(ema_decay, (int, float))
            or not 0.0 <= ema_decay <= 1.0
        ):
            raise ValueError(f"ema_decay={ema_decay!r}; expected None or a float in [0, 1]")
        self.model = model
        self.seq_len = int(seq_len)
        self.loss_role = None if loss_role is None else int(loss_role)
        self.ema_decay = None if ema_decay is None else float(ema_decay)
        self.vocab_size = getattr(config, "vocab_size", None)
        # Models offering features + cross_entropy (CausalTransformer) get the fused loss.
        self._fused = callable(getattr(model, "features", None)) and callable(
            getattr(model, "cross_entropy", None)
        )
        self.pretrained = None
        if pretrained is not None:
            self.pretrained = check_variables(pretrained, "pretrained")
            self._check_pretrained()

    # ------------------------------------------------------------------ variables

    def _example(self) -> jax.Array:
        return jnp.zeros((1, self.seq_len), jnp.int32)

    def _check_pretrained(self) -> None:
        expected = jax.eval_shape(self.model.init, jax.random.key(0), self._example())
        check_shapes(self.pretrained, expected)

    def init(self, key: jax.Array) -> Variables:
        """A copy of ``pretrained``, or a random initialization from ``key``."""
        if self.pretrained is not None:
            # A copy: the trainer donates its parameters, the caller keeps theirs.
            return jax.tree.map(jnp.array, self.pretrained)
        return self.model.init(key, self._example())

    # ------------------------------------------------------------------ batches

    def _check_layout(self, batch: Mapping[str, Any]) -> None:
        """Shape and presence checks that need no values (run under tracing too)."""
        if "text" not in batch:
            raise ValueError(f"batch has no field 'text'; fields are {sorted(batch)}")
        width = self.seq_len + 1
        shape = tuple(np.shape(batch["text"]))
        if len(shape) != 2 or shape[1] != width:
            raise ValueError(
                f"batch field 'text' has shape {shape}; LMObjective(seq_len={self.seq_len}) "
                f"expects [B, {width}]"
            )
        for name in _OPTIONAL:
            if name in batch and tuple(np.shape(batch[name])) != shape:
                raise ValueError(
                    f"batch field {name!r} has shape {tuple(np.shape(batch[name]))}; "
                    f"expected the shape of 'text', {shape}"
                )
        if self.loss_role is not None and "text_roles" not in batch:
            raise ValueError(
                f"batch has no field 'text_roles'; LMObjective(loss_role={self.loss_role}) "
                "counts targets by role and needs it"
            )

    def validate(self, batch: Mapping[str, np.ndarray]) -> None:
        """Check a host batch before it reaches a compiled function.

        Raises:
            ValueError: naming the field, its shape or value, and what was expected.
        """
        self._check_layout(batch)
        for name in ("text", *_OPTIONAL):
            if name in batch and np.asarray(batch[name]).dtype.kind not in "iu":
                raise ValueError(
                    f"batch field {name!r} has dtype {np.asarray(batch[name]).dtype}; "
                    "expected integers"
                )
        text = np.asarray(batch["text"])
        if text.size and (text.min() < 0 or (self.vocab_size and text.max() >= self.vocab_size)):
            bad = text.min() if text.min() < 0 else text.max()
            raise ValueError(
                f"batch field 'text' holds token id {bad}; expected ids in "
                f"[0, {self.vocab_size or 'vocab_size'})"
            )
        for name in ("text_segment_ids", "text_positions"):
            if name in batch and np.asarray(batch[name]).size and np.min(batch[name]) < 0:
                raise ValueError(
                    f"batch field {name!r} holds {np.min(batch[name])}; expected values >= 0"
                )

    def _nll(self, params: Variables, batch: Mapping[str, jax.Array], key: jax.Array | None):
        """Per-target negative log-likelihood, counted mask and correctness, ``[B, L]``."""
        self._check_layout(batch)
        text = batch["text"]
        segments = batch.get("text_segment_ids")
        positions = batch.get("text_positions")
        mask = target_mask(segments, batch.get("text_roles"), self.loss_role, text[:, 1:].shape)
        kwargs = {
            "segment_ids": None if segments is None else segments[:, :-1],
            "positions": None if positions is None else positions[:, :-1],
        }
        if key is not None:
            kwargs["rngs"] = {"dropout": key}
        targets = text[:, 1:]
        if self._fused:
            # features + the model's fused head/cross-entropy: no [B, L, V] logits for autodiff.
            hidden = self.model.apply(params, text[:, :-1], method="features", **kwargs)
            nll, correct = self.model.apply(params, hidden, targets, method="cross_entropy")
            return nll, mask, correct
        logits = self.model.apply(params, text[:, :-1], **kwargs).astype(jnp.float32)
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        correct = jnp.argmax(logits, axis=-1) == targets
        return nll, mask, correct

    # ------------------------------------------------------------------ protocol

    def loss(
        self,
        params: Variables,
        batch: Mapping[str, jax.Array],
        key: jax.Array,
        ema: Variables | None = None,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Mean next-token NLL over counted targets (0 when none count).

        Returns:
            ``(loss, {"loss", "tokens", "accuracy"})``; ``tokens`` is the number of
            counted targets (float32).
        """
        nll, mask, correct = self._nll(params, batch, key)
        tokens = jnp.sum(mask, dtype=jnp.float32)
        denominator = jnp.maximum(tokens, 1.0)
        loss = jnp.sum(jnp.where(mask, nll, 0.0)) / denominator
        accuracy = jnp.sum(mask & correct, dtype=jnp.float32) / denominator
        return loss, {"loss": loss, "tokens": tokens, "accuracy": accuracy}

    def evaluate(self, params: Variables, batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        """Sums over one batch: ``nll``, ``tokens`` (counted targets) and ``correct``."""
        nll, mask, correct = self._nll(params, batch, None)
        return {
            "nll": jnp.sum(jnp.where(mask, nll, 0.0)),
            "tokens": jnp.sum(mask, dtype=jnp.float32),
            "correct": jnp.sum(mask & correct, dtype=jnp.float32),
        }

    def summarize(self, totals: Mapping[str, float]) -> dict[str, float]:
        """Mean loss, perplexity ``exp(loss)``, accuracy and token count.

        Raises:
            ValueError: when no target was counted.
        """
        nll = summarize_nll(
            totals,
            counted="target tokens",
            expected="batches with real, same-document targets (and the loss_role, when set)",
        )
        return {
            "loss": nll["loss"],
            "perplexity": nll["perplexity"],
            "accuracy": float(totals["correct"]) / nll["tokens"],
            "tokens": nll["tokens"],
        }


def summarize_nll(totals: Mapping[str, float], *, counted: str, expected: str) -> dict[str, float]:
    """Mean negative log-likelihood (``loss``), ``perplexity`` and ``tokens`` from summed totals.

    The one ``summarize`` of every objective whose evaluation sums an ``nll`` over ``tokens``
    (language modelling, DPO's chosen answers, GRPO's prompts).

    Args:
        totals: summed evaluation outputs with ``nll`` and ``tokens``.
        counted: what ``tokens`` counts, for the error (``"target tokens"``).
        expected: what data would have counted some, for the error.

    Returns:
        ``{"loss": nll / tokens, "perplexity": exp(loss), "tokens": tokens}``; the
        perplexity is ``inf`` when ``exp`` overflows.

    Raises:
        ValueError: when ``tokens`` is 0, naming what was counted and what was expected.

    Example:
        >>> summarize_nll({"nll": 0.0, "tokens": 4.0}, counted="tokens", expected="text")
        {'loss': 0.0, 'perplexity': 1.0, 'tokens': 4.0}
    """
    tokens = float(totals["tokens"])
    if tokens <= 0:
        raise ValueError(f"validation counted 0 {counted}; expected {expected}")
    loss = float(totals["nll"]) / tokens
    try:
        perplexity = math.exp(loss)
    except OverflowError:
        perplexity = math.inf
    return {"loss": loss, "perplexity": perplexity, "tokens": tokens}
