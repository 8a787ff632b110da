"""Greedy completion of short prompts in one compiled call, for exact-match evaluation.

Evaluating a generated task needs the model's argmax answer to a few thousand short prompts.
Answers here are a handful of tokens, so the loop simply runs the decoder over the whole
``[B, P + R]`` window once per new token (``R`` passes, no key/value cache): for windows of a
few dozen tokens that costs little more than cached decoding and has no cache bookkeeping to
get wrong. Left padding is masked with segment 0 and positions restart at each prompt's first
real id, exactly as in training rows, so a prompt's completion does not depend on its padding.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["greedy_complete"]


@functools.partial(jax.jit, static_argnames=("model", "budget", "eos_id", "pad_id"))
def _complete(
    model: Any,
    variables: Any,
    prompts: jax.Array,
    lengths: jax.Array,
    *,
    budget: int,
    eos_id: int,
    pad_id: int,
) -> tuple[jax.Array, jax.Array]:
    batch, width = prompts.shape
    columns = jnp.arange(width + budget, dtype=jnp.int32)[None, :]
    start = (width - lengths)[:, None]
    segments = (columns >= start).astype(jnp.int32)
    positions = jnp.maximum(columns - start, 0)
    tokens = jnp.concatenate([prompts, jnp.full((batch, budget), pad_id, jnp.int32)], axis=1)

    def step(t: jax.Array, carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        tokens, done = carry
        # Columns after width - 1 + t hold no real ids yet; the causal mask keeps them from
        # reaching the column read here.
        hidden = model.apply(variables, tokens, segments, positions, method="features")
        last = jax.lax.dynamic_index_in_dim(hidden, width - 1 + t, axis=1, keepdims=False)
        logits = model.apply(variables, last, method="logits")
        chosen = jnp.where(done, pad_id, jnp.argmax(logits, axis=-1).astype(jnp.int32))
        tokens = jax.lax.dynamic_update_index_in_dim(tokens, chosen, width + t, axis=1)
        return tokens, done | (chosen == eos_id)

    done = jnp.zeros((batch,), bool)
    tokens, done = jax.lax.fori_loop(0, budget, step, (tokens, done))
    completion = tokens[:, width:]
    hit = completion == eos_id
    count = jnp.where(hit.any(axis=1), jnp.argmax(hit, axis=1) + 1, budget)
    return completion, count.astype(jnp.int32)


def greedy_complete(
    model: Any,
    variables: Any,
    prompts: np.ndarray,
    prompt_lengths: np.ndarray,
    max_new_tokens: int,
    *,
    eos_id: int,
    pad_id: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Argmax-decode up to ``max_new_tokens`` ids after each left-padded prompt.

    Args:
        model: a decoder with the ``features``/``logits`` call forms of
            ``models.build("causal_transformer", ...)``.
        variables: its ``{"params": ...}``.
        prompts: int ``[B, P]`` ids; row b's prompt is its last ``prompt_lengths[b]`` columns.
        prompt_lengths: int ``[B]``, each in ``[1, P]``.
        max_new_tokens: the budget ``R`` (>= 1); ``P + R`` must not exceed ``max_seq_len``.
        eos_id: the id that ends a completion (kept in it).
        pad_id: written after a completion has ended.

    Returns:
        ``(ids, lengths)``: int32 ``[B, R]`` completions (``pad_id`` after the EOS) and int32
        ``[B]`` ids per completion, the EOS included (``R`` when none was produced).

    Raises:
        ValueError: bad shapes, lengths out of range, ids outside the vocabulary, or a window
            longer than the model's ``max_seq_len``.

    Example:
        >>> ids, lengths = greedy_complete(model, variables, prompts, prompt_lengths, 5,
        ...                                eos_id=2)  # doctest: +SKIP
    """
    prompts = np.asarray(prompts)
    lengths = np.asarray(prompt_lengths)
    if prompts.ndim != 2 or prompts.shape[0] < 1 or prompts.shape[1] < 1:
        raise ValueError(
            f"prompts has shape {prompts.shape}; expected [batch, width] with both >= 1"
        )
    if prompts.dtype.kind not in "iu":
        raise ValueError(f"prompts has dtype {prompts.dtype}; expected integer ids")
    if lengths.shape != prompts.shape[:1] or lengths.dtype.kind not in "iu":
        raise ValueError(
            f"prompt_lengths has shape {lengths.shape} and dtype {lengths.dtype}; expected "
            f"integers of shape ({prompts.shape[0]},)"
        )
    if lengths.min() < 1 or lengths.max() > prompts.shape[1]:
        raise ValueError(
            f"prompt_lengths holds values in [{lengths.min()}, {lengths.max()}]; expected each "
            f"in [1, {prompts.shape[1]}]"
        )
    if (
        isinstance(max_new_tokens, bool)
        or not isinstance(max_new_tokens, int)
        or max_new_tokens < 1
    ):
        raise ValueError(f"max_new_tokens is {max_new_tokens!r}; expected an int >= 1")
    config = model.config
    if prompts.shape[1] + max_new_tokens > config.max_seq_len:
        raise ValueError(
            f"prompt width {prompts.shape[1]} + max_new_tokens {max_new_tokens} exceeds the "
            f"model's max_seq_len={config.max_seq_len}"
        )
    if prompts.min() < 0 or prompts.max() >= config.vocab_size:
        raise ValueError(
            f"prompts holds ids in [{prompts.min()}, {prompts.max()}]; expected ids in "
            f"[0, {config.vocab_size})"
        )
    ids, counts = _complete(
        model,
        variables,
        jnp.asarray(prompts, jnp.int32),
        jnp.asarray(lengths, jnp.int32),
        budget=max_new_tokens,
        eos_id=int(eos_id),
        pad_id=int(pad_id),
    )
    return np.asarray(ids), np.asarray(counts)
