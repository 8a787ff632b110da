"""GRPO on packed rows: score each sampled id against its own chain, then the policy loss.

A packed batch (``[N, W]`` columns, see :mod:`dew_pipe.objectives.rl.packing`) holds
chains back to back; the decoder reads them through ``text_segment_ids`` and
``text_positions``, so every id is scored against its own chain's prefix only and
packing changes nothing but the layout (``tests/test_packed_grpo.py`` checks the loss
and its gradients against one chain per row). The per-token arrays then go through
:func:`dew_pipe.objectives.rl.policy.policy_loss`, which holds the clipped surrogate,
the behavior corrections, the aggregation and the k3 KL term.

Scoring at a sampling temperature (``sampling_temperature=T``) divides the logits the
model returns (after any softcap it applies) by ``T``; where the batch carries
``support_ids``/``support_columns`` the distribution of a sampled id is renormalised over
the ids the sampler kept for it, the sampled id always included (slime's top-p replay).
The entropy metric reads the temperature-scaled logits without that restriction.

With ``response_columns=K`` the loss runs the output head and the log-softmax on ``K``
columns per row (its sampled ids, padded with its first other columns, in column order)
instead of on all ``W - 1``: in RL batches most columns are prompt ids whose
log-probabilities the loss never reads, and the head (``[tokens, D] x [D, V]``, forward and
backward) is among the step's largest matmuls. A `CausalTransformer` goes further
(``features(..., columns=)``): its last block computes the queries, attention output and
MLP of those ``K`` columns alone, since no other column's output reaches the loss; its keys
and values still cover every column, and since the columns increase, each block of their
queries skips the keys past its last column's reach (``increasing_columns``). A step whose
batch has a row with more than ``K`` sampled ids runs whole rows instead (both are compiled;
``lax.cond`` picks one per step), and its metric ``response_columns_overflow`` is 1. Either
way the loss is the same, up to float rounding.

Rows packed with ``share_prompts=True`` carry ``text_prefix_segments``: a group's prompt is
written once and each completion reads its keys from there. The model gets the column as
``prefix_segments=`` (a custom model passed here must accept it, as `CausalTransformer`
does); every sampled id is scored from the same context as in a plain row
(``tests/test_shared_prompts.py``).

Validation (``evaluate``) scores prompt perplexity: the mean negative log-likelihood of
the raw model over real next-token transitions that the sampler did not draw, in packed
batches (prompts and observations) and in prompt batches (``prompt``/``prompt_length``,
left padded).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dew_pipe.models.transformer import CausalTransformer
from dew_pipe.objectives.lm import summarize_nll
from dew_pipe.objectives.rl import losses as L
from dew_pipe.objectives.rl.grpo_batches import (
    check_packed_layout,
    check_prompt_layout,
    validate_packed,
    validate_prompts,
)
from dew_pipe.objectives.rl.policy import PolicyOptions, policy_loss
from dew_pipe.training.objective import Variables, check_shapes, check_variables

__all__ = ["GRPOObjective", "prompt_rows", "token_log_probs"]


def token_log_probs(
    logits: jax.Array,
    targets: jax.Array,
    *,
    temperature: float | None = None,
    support: tuple[jax.Array, jax.Array] | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Log-probability of each target and the entropy of its distribution.

    Args:
        logits: ``[N, S, V]`` float logits; position ``s`` predicts ``targets[:, s]``.
        targets: ``[N, S]`` int ids.
        temperature: divide the logits by it first (None: 1).
        support: ``(ids, at)``, both ``[N, C]`` int: entry ``k`` of row ``n`` keeps id
            ``ids[n, k]`` in the distribution of prediction ``at[n, k]`` (-1: unused).
            A prediction with entries is renormalised over them and its target (slime's
            top-p replay); one without keeps the whole vocabulary.

    Returns:
        ``(log_probs, entropy)``, both ``[N, S]``; the entropy is that of the whole
        (temperature-scaled) vocabulary and is not differentiated.

    Example:
        >>> logits = jnp.log(jnp.array([[[0.5, 0.25, 0.25]]]))
        >>> lp, _ = token_log_probs(logits, jnp.array([[1]]),
        ...                         support=(jnp.array([[0]]), jnp.array([[0]])))
        >>> round(float(jnp.exp(lp[0, 0])), 4)   # 0.25 / (0.5 + 0.25)
        0.3333
    """
    logits = logits.astype(jnp.float32)
    if temperature is not None:
        logits = logits / temperature
    entropy = jax.lax.stop_gradient(_entropy(logits))
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    targets = jnp.asarray(targets, jnp.int32)
    picked = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    if support is None:
        return picked, entropy
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    ids, at = (jnp.asarray(a, jnp.int32) for a in support)
    restricted, present = _support_log_probs(logits, targets, target_logit, ids, at)
    return jnp.where(present, restricted, picked), entropy


def _entropy(logits: jax.Array) -> jax.Array:
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)


def _support_log_probs(
    logits: jax.Array, targets: jax.Array, target_logit: jax.Array, ids: jax.Array, at: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Target log-probabilities renormalised over recorded supports, without a [N, S, V] mask.

    Gathers the logit of every support entry and takes a log-sum-exp per prediction with
    segment reductions, so the extra memory is ``O(N * C)``; the target joins its support
    when the record left it out. Returns ``(log_probs, present)``, both ``[N, S]``.
    """
    rows, steps, vocab = logits.shape
    valid = (at >= 0) & (at < steps) & (ids >= 0) & (ids < vocab)
    row = jnp.broadcast_to(jnp.arange(rows)[:, None], ids.shape)
    step, token = jnp.where(valid, at, 0), jnp.where(valid, ids, 0)
    count = rows * steps
    # One bin per prediction, plus a spare bin that collects the unused entries.
    group = jnp.where(valid, row * steps + step, count).reshape(-1)
    flat_valid = valid.reshape(-1)
    z = jnp.where(flat_valid, logits[row, step, token].reshape(-1), 0.0)
    present = jax.ops.segment_sum(flat_valid.astype(jnp.int32), group, count + 1) > 0
    peak = jax.ops.segment_max(jnp.where(flat_valid, z, -jnp.inf), group, count + 1)
    peak = jax.lax.stop_gradient(jnp.where(present, peak, 0.0))
    # Every branch stays finite, so no NaN reaches the gradient through a masked path.
    terms = jnp.where(flat_valid, jnp.exp(jnp.where(flat_valid, z - peak[group], 0.0)), 0.0)
    mass = jax.ops.segment_sum(terms, group, count + 1)
    lse = (peak + jnp.log(jnp.where(present, mass, 1.0)))[:count].reshape(rows, steps)
    hit = ((token == targets[row, step]) & valid).reshape(-1).astype(jnp.int32)
    has_target = (jax.ops.segment_max(hit, group, count + 1) > 0)[:count].reshape(rows, steps)
    lse = jnp.where(has_target, lse, jnp.logaddexp(lse, target_logit))
    return target_logit - lse, present[:count].reshape(rows, steps)


def _sampled_head(
    head: Any,
    hidden_at: Any,
    targets: jax.Array,
    sampled: jax.Array,
    columns: int,
    temperature: float | None,
) -> tuple[jax.Array, jax.Array]:
    """`token_log_probs` of the sampled targets only, the head run on ``columns`` per row.

    ``hidden_at(order)`` gives the hidden states ``[N, columns, D]`` at columns ``order``
    of each row; the hidden state at column c predicts ``targets [N, S]`` at c, and
    ``sampled [N, S]`` marks the ones wanted, at most ``columns`` per row. Each row takes
    its marked positions and, to make up ``columns``, its first unmarked ones, in column
    order (strictly increasing, which `CausalTransformer.features` can exploit); the head
    and log-softmax run on ``[N, columns]`` and the results go back to their columns, 0 in
    the others. Returns ``[N, S]`` twice.
    """
    chosen = jnp.argsort(~sampled, axis=1, stable=True)[:, :columns]  # marked ones first
    order = jnp.sort(chosen, axis=1)
    kept = jnp.take_along_axis(sampled, order, axis=1)
    picked = hidden_at(order)
    log_probs, entropy = token_log_probs(
        head(picked), jnp.take_along_axis(targets, order, axis=1), temperature=temperature
    )
    rows = jnp.arange(targets.shape[0])[:, None]

    def scatter(values: jax.Array) -> jax.Array:
        # order holds distinct columns per row, so each lands once
        return (
            jnp.zeros(targets.shape, values.dtype)
            .at[rows, order]
            .set(jnp.where(kept, values, 0.0), unique_indices=True)
        )

    return scatter(log_probs), scatter(entropy)


def prompt_rows(prompt: jax.Array, prompt_length: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Segment ids and positions of left-padded prompts ``[B, P]``.

    Returns:
        ``(segment_ids, positions)``: 1 on the last ``prompt_length`` ids of each row and
        0 on its padding; positions count from 0 at each row's first real id.
    """
    width = prompt.shape[1]
    start = (width - prompt_length)[:, None]
    columns = jnp.arange(width)[None, :]
    real = columns >= start
    return real.astype(jnp.int32), jnp.where(real, columns - start, 0).astype(jnp.int32)


class GRPOObjective:
    """Group-relative policy optimisation of a causal decoder on packed rows.

    Args:
        model: a Flax linen decoder called as ``model.apply(variables, tokens, segment_ids,
            positions) -> logits [B, S, V]`` (``models.build("causal_transformer", ...)``).
        seq_len: ``W - 1`` for packed rows ``[N, W]`` (one fewer for the next-token shift).
        beta: coefficient of the k3 KL penalty against the frozen reference; a positive
            value keeps the starting weights in the EMA slot with decay 1.
        pretrained: starting variables ``{"params": ...}``, copied at init; when
            ``beta > 0`` the trainer freezes those starting weights as the reference (the
            EMA slot starts as the initial parameters). None initializes randomly.
        epsilon_low, epsilon_high, dual_clip, policy_loss, aggregation,
        behavior_importance, sequence_mask, geometric_mask: see
            :class:`~dew_pipe.objectives.rl.policy.PolicyOptions`.
        sampling_temperature: score sampled ids at this temperature (and over their
            recorded ``support_ids``); None scores the raw model, as ``old_log_probs``
            records it.
        kl_estimator: the reference KL estimator, "k3" (verl's ``low_var_kl``) unless you
            ask for "k1", "k2" or "abs"; a trailing "+" keeps the value and takes k2's
            unbiased gradient.
        proximal_in_step: take ``old_log_probs`` (the proximal policy) from the loss's own
            forward pass, detached, instead of from the batch. Those are the likelihoods
            under the weights the update starts from, which is what a scheduler's rescoring
            computes, so the result is the same while the separate rescoring forward pass
            is saved (a ``RolloutScheduler`` then leaves its rescore stage out). It holds
            when each batch trains one update, as the Trainer does (accumulated
            microbatches share the weights); a batch rescored once and trained for several
            updates needs the rescored column. Any ``old_log_probs`` in the batch is
            ignored.
        response_columns: the most sampled ids (``response_mask``) one packed row holds;
            the loss then scores only those columns of each row, and a
            `CausalTransformer`'s last block computes only them (see the module
            docstring). ``SampledRollout`` rows hold one chain each unless short chains
            share a row, so its ``max_new_tokens`` is the usual value. None (the default)
            scores every column. Needs a model with ``features`` and ``logits`` call forms
            (`CausalTransformer`); batches with ``support_ids`` are scored whole.

    Raises:
        TypeError: a model without ``init``/``apply``, or a ``pretrained`` that is not a
            mapping; ``response_columns`` for a model without ``features``/``logits``.
        ValueError: an option out of range, naming it; ``seq_len`` beyond the model's
            ``max_seq_len``; ``pretrained`` whose leaves do not match the model.

    Example:
        >>> from dew_pipe import models
        >>> from dew_pipe.objectives.rl import Call, Session, pack
        >>> model = models.build("causal_transformer", vocab_size=8, emb_features=16,
        ...                      num_layers=1, num_heads=2, mlp_features=32, max_seq_len=8)
        >>> sessions = [Session(0, 0, k, 0, [Call([1, 2], [3 + k, 7], [-0.5, -0.1], "stop", 0)],
        ...                     "COMPLETED", reward=float(k)) for k in range(2)]
        >>> batch = pack(sessions, 8)
        >>> objective = GRPOObjective(model, seq_len=7, beta=0.01)
        >>> variables = objective.init(jax.random.key(0))
        >>> objective.validate(batch)
        >>> loss, metrics = objective.loss(variables, batch, jax.random.key(1), variables)
        >>> float(metrics["tokens"]), float(metrics["kl_loss"])
        (4.0, 0.0)
    """

    def __init__(
        self,
        model: Any,
        seq_len: int,
        beta: float = 0.0,
        pretrained: Variables | None = None,
        epsilon_low: float = 0.2,
        epsilon_high: float = 0.2,
        dual_clip: float | None = 3.0,
        policy_loss: str = "ppo",
        aggregation: str = "token-mean",
        behavior_importance: float | tuple[float, float] | None = None,
        sequence_mask: tuple[float, float] | None = None,
        geometric_mask: tuple[float, float] | None = None,
        sampling_temperature: float | None = None,
        *,
        kl_estimator: str = "k3",
        proximal_in_step: bool = False,
        response_columns: int | None = None,
    ) -> None:
        if not (callable(getattr(model, "init", None)) and callable(getattr(model, "apply", None))):
            raise TypeError(f"model is a {type(model).__name__}; expected a Flax linen Module")
        if isinstance(seq_len, bool) or not isinstance(seq_len, int | np.integer) or seq_len < 1:
            raise ValueError(f"seq_len={seq_len!r}; expected an int >= 1")
        if response_columns is not None:
            if (
                isinstance(response_columns, bool)
                or not isinstance(response_columns, int | np.integer)
                or not 1 <= response_columns <= seq_len
            ):
                raise ValueError(
                    f"response_columns={response_columns!r}; expected None or an int from 1 "
                    f"to seq_len={seq_len}"
                )
            if not all(callable(getattr(model, m, None)) for m in ("features", "logits")):
                raise TypeError(
                    f"response_columns={response_columns} needs a model with 'features' and "
                    f"'logits' call forms (a CausalTransformer); {type(model).__name__} has not"
                )
        config = getattr(model, "config", None)
        max_len = getattr(config, "max_seq_len", None)
        if max_len is not None and seq_len > max_len:
            raise ValueError(f"seq_len={seq_len} exceeds the model's max_seq_len={max_len}")
        if sampling_temperature is not None and (
            isinstance(sampling_temperature, bool)
            or not isinstance(sampling_temperature, int | float)
            or not 0 < sampling_temperature < math.inf
        ):
            raise ValueError(
                f"sampling_temperature={sampling_temperature!r}; expected None or a number > 0"
            )
        if not isinstance(proximal_in_step, bool):
            raise TypeError(f"proximal_in_step={proximal_in_step!r}; expected True or False")
        self.options = PolicyOptions(
            beta=beta,
            epsilon_low=epsilon_low,
            epsilon_high=epsilon_high,
            dual_clip=dual_clip,
            policy_loss=policy_loss,
            aggregation=aggregation,
            behavior_importance=behavior_importance,
            sequence_mask=sequence_mask,
            geometric_mask=geometric_mask,
            kl_estimator=kl_estimator,
        )
        self.model = model
        self.seq_len = int(seq_len)
        self.beta = float(beta)
        self.proximal_in_step = proximal_in_step
        self.response_columns = None if response_columns is None else int(response_columns)
        self.sampling_temperature = (
            None if sampling_temperature is None else float(sampling_temperature)
        )
        self.vocab_size = getattr(config, "vocab_size", None)
        self.pretrained = None
        if pretrained is not None:
            self.pretrained = check_variables(pretrained, "pretrained")
            self._check_pretrained()

    @property
    def ema_decay(self) -> float | None:
        """1.0 (a frozen reference in the EMA slot) when ``beta > 0``, else None."""
        return 1.0 if self.beta > 0 else None

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

    # ------------------------------------------------------------------ scoring

    def _score(
        self,
        variables: Variables,
        batch: Mapping[str, jax.Array],
        temperature: float | None,
        *,
        columns: int | None = None,
    ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """Per-id log-probabilities, entropies and scorable mask, all ``[N, W]``, and a
        float32 flag: 1 when ``columns`` was asked for but a row held more sampled ids.

        With ``columns`` the log-probabilities and entropies are those of the sampled ids
        (``response_mask``) only, 0 elsewhere; without, of every scorable id.
        """
        ids, segments = batch["input_ids"], batch["text_segment_ids"]
        positions = batch["text_positions"]
        shared = {}
        if "text_prefix_segments" in batch:  # rows packed with share_prompts
            shared = {"prefix_segments": batch["text_prefix_segments"][:, :-1]}
        support = None
        if temperature is not None and "support_ids" in batch:
            # The logits predicting column c sit at c - 1; padding (-1) falls outside.
            support = (batch["support_ids"], batch["support_columns"] - 1)
        targets = ids[:, 1:]
        overflow = jnp.float32(0.0)
        if columns is None or support is not None or columns >= targets.shape[1]:
            logits = self.model.apply(
                variables, ids[:, :-1], segments[:, :-1], positions[:, :-1], **shared
            )
            log_probs, entropy = token_log_probs(
                logits, targets, temperature=temperature, support=support
            )
        else:
            inputs = (ids[:, :-1], segments[:, :-1], positions[:, :-1])
            sampled = batch["response_mask"][:, 1:] > 0
            fits = jnp.max(jnp.sum(sampled, axis=1)) <= columns
            overflow = 1.0 - fits.astype(jnp.float32)
            model = self.model

            def head(hidden: jax.Array) -> jax.Array:
                return model.apply(variables, hidden, method="logits")

            def whole_head(hidden: jax.Array) -> tuple[jax.Array, jax.Array]:
                return token_log_probs(head(hidden), targets, temperature=temperature)

            if isinstance(model, CausalTransformer):
                # The last block runs on the gathered columns too, so each branch holds the
                # whole forward pass (both read `variables` from this scope). Under
                # autodiff a cond passes its backward the residuals of both branches, zeros
                # for the one not taken: the rare whole-row branch is rematerialized, so
                # its residuals are only its inputs.
                def whole() -> tuple[jax.Array, jax.Array]:
                    return whole_head(model.apply(variables, *inputs, method="features", **shared))

                def gathered() -> tuple[jax.Array, jax.Array]:
                    def hidden_at(order: jax.Array) -> jax.Array:
                        return model.apply(
                            variables,
                            *inputs,
                            method="features",
                            columns=order,
                            increasing_columns=True,  # _sampled_head sorts them
                            **shared,
                        )

                    return _sampled_head(head, hidden_at, targets, sampled, columns, temperature)

                log_probs, entropy = jax.lax.cond(fits, gathered, jax.checkpoint(whole))
            else:  # any other model: the forward pass once, the head alone under the cond

                def picked(hidden: jax.Array) -> tuple[jax.Array, jax.Array]:
                    def taken(order: jax.Array) -> jax.Array:
                        return jnp.take_along_axis(hidden, order[..., None], axis=1)

                    return _sampled_head(head, taken, targets, sampled, columns, temperature)

                hidden = model.apply(variables, *inputs, method="features", **shared)
                log_probs, entropy = jax.lax.cond(fits, picked, whole_head, hidden)
        scorable = (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] > 0)
        pad = jnp.zeros((ids.shape[0], 1), bool)
        scorable = jnp.concatenate([pad, scorable], axis=1)
        log_probs = jnp.concatenate([pad.astype(log_probs.dtype), log_probs], axis=1)
        entropy = jnp.concatenate([pad.astype(entropy.dtype), entropy], axis=1)
        scored = scorable if columns is None else scorable & (batch["response_mask"] > 0)
        return (
            jnp.where(scored, log_probs, 0.0),
            jnp.where(scored, entropy, 0.0),
            scorable,
            overflow,
        )

    def packed_log_probs(self, params: Variables, batch: Mapping[str, jax.Array]) -> jax.Array:
        """Log-probability of every id given its own chain's prefix, ``[N, W]`` float32.

        Scored at ``sampling_temperature`` (and over ``support_ids``) when set, as the loss
        scores the current policy; 0 where an id starts its chain or is padding. A
        scheduler that rescores the proximal policy stores this as ``old_log_probs``.

        Raises:
            ValueError: a missing column or a shape that is not ``[N, seq_len + 1]``.
        """
        check_packed_layout(batch, self.seq_len, self.options, require_policy=False)
        return self._score(params, batch, self.sampling_temperature)[0]

    # ------------------------------------------------------------------ protocol

    def loss(
        self,
        params: Variables,
        batch: Mapping[str, jax.Array],
        key: jax.Array,
        ema: Variables | None = None,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The GRPO loss of one packed batch.

        Returns:
            ``(loss, metrics)``: the metrics of
            :func:`~dew_pipe.objectives.rl.policy.policy_loss` plus ``loss`` and
            ``entropy`` (token mean over the trainable tokens).

        Raises:
            ValueError: at trace time, a missing column or wrong shape, a TIS cap on a
                batch without ``old_log_probs``, or ``beta > 0`` without ``ema``.
        """
        del key
        check_packed_layout(
            batch, self.seq_len, self.options, proximal_in_step=self.proximal_in_step
        )
        if self.beta > 0 and ema is None:
            raise ValueError(
                f"ema: GRPOObjective(beta={self.beta}) needs the frozen reference in the EMA "
                "slot; the trainer passes it when ema_decay is 1.0"
            )
        columns = self.response_columns
        log_prob, entropy, _, overflow = self._score(
            params, batch, self.sampling_temperature, columns=columns
        )
        old = batch.get("old_log_probs")
        if self.proximal_in_step:
            old = jax.lax.stop_gradient(log_prob)
        ref = None
        if self.beta > 0:
            ref = self._score(
                jax.lax.stop_gradient(ema), batch, self.sampling_temperature, columns=columns
            )[0]
        chains = L.chain_ids(batch["text_segment_ids"])
        value, metrics = policy_loss(
            self.options,
            log_prob,
            advantages=batch["advantages"],
            response_mask=batch["response_mask"],
            behavior_log_prob=batch["behavior_log_probs"],
            old_log_prob=old,
            ref_log_prob=ref,
            chains=chains,
            sessions=batch.get("session_index"),
        )
        metrics["loss"] = jax.lax.stop_gradient(value)
        metrics["entropy"] = L.masked_mean(entropy, batch["response_mask"].astype(jnp.float32))
        if columns is not None:
            metrics["response_columns_overflow"] = overflow
        return value, metrics

    def evaluate(self, params: Variables, batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        """Prompt perplexity sums over one batch: ``nll`` and ``tokens``.

        Packed batches count real transitions inside a chain whose target was not sampled;
        prompt batches (``prompt``, ``prompt_length``) count the transitions inside each
        prompt. The raw model scores them (no temperature).
        """
        if "input_ids" in batch:
            check_packed_layout(batch, self.seq_len, self.options, require_policy=False)
            log_probs, _, counted, _ = self._score(params, batch, None)
            if "response_mask" in batch:
                counted = counted & (batch["response_mask"] == 0)
        else:
            check_prompt_layout(batch, self.seq_len)
            prompt = batch["prompt"]
            segments, positions = prompt_rows(prompt, batch["prompt_length"])
            rows = {"input_ids": prompt, "text_segment_ids": segments, "text_positions": positions}
            log_probs, _, counted, _ = self._score(params, rows, None)
        return {
            "nll": -jnp.sum(jnp.where(counted, log_probs, 0.0)),
            "tokens": jnp.sum(counted, dtype=jnp.float32),
        }

    def summarize(self, totals: Mapping[str, float]) -> dict[str, float]:
        """Mean prompt NLL (``loss``), ``perplexity`` and ``tokens``.

        Raises:
            ValueError: when no transition was counted.
        """
        return summarize_nll(
            totals,
            counted="prompt transitions",
            expected="prompts of at least two real ids (or packed chains with unsampled ids "
            "after their first)",
        )

    def validate(self, batch: Mapping[str, np.ndarray]) -> None:
        """Check a host batch (packed rows, or prompts for validation) before any compile.

        Raises:
            ValueError: naming the field, its shape or value, and what was expected:
                missing or misaligned behavior likelihoods, sampled ids that have no
                prefix in their chain, a TIS cap without recorded old log-probabilities,
                ids outside the vocabulary, support entries off the sampled ids.
        """
        if "input_ids" not in batch and "prompt" in batch:
            validate_prompts(batch, self.seq_len, self.vocab_size)
            return
        validate_packed(
            batch,
            self.seq_len,
            self.options,
            self.vocab_size,
            proximal_in_step=self.proximal_in_step,
        )
