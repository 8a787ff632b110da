"""The LM head fused with softmax cross-entropy, with a hand-written backward pass.

`head_cross_entropy` maps final hidden states and target ids to per-token negative
log-likelihoods (and whether the target is the argmax) without handing the ``[N, V]``
logits to autodiff:

- The forward keeps one float32 log-normalizer per token. The backward rebuilds each
  chunk's logits with one matmul and forms ``(softmax - onehot) * dNLL`` directly, so no
  logits-sized tensor is stored between the passes (XLA may still reuse the forward's
  logits when it sees they are the same computation).
- Tokens are processed in chunks of rows whose logits stay within a fixed element budget
  (a ``lax.scan`` over chunks); a small batch is a single chunk. So a large vocabulary
  (150k ids) over many tokens never materializes all logits at once, forward or backward.
- "Correct" is the first index of the row maximum, as ``jnp.argmax`` defines it, found by
  a masked minimum over ids: XLA's CPU backend runs the generic argmax (a reduction over
  value-index pairs) several times slower than two plain reductions.

Values match ``optax.softmax_cross_entropy_with_integer_labels`` on the float32 logits of
`CausalTransformer.logits` to float32 rounding; the head's matmul runs in the hidden
states' dtype with float32 accumulation, as `CausalTransformer.logits` does.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from dew_pipe.models.layout import row_major_transpose, weight_gradient

__all__ = ["head_cross_entropy"]

_CHUNK_ELEMENTS = 1 << 24  # logits per chunk: 64 MiB of float32


def head_cross_entropy(
    hidden: jax.Array,
    kernel: jax.Array,
    targets: jax.Array,
    *,
    transposed: bool = False,
    chunk_elements: int = _CHUNK_ELEMENTS,
) -> tuple[jax.Array, jax.Array]:
    """Per-token NLL of ``targets`` under ``softmax(hidden @ kernel)``, and argmax hits.

    Args:
        hidden: ``[..., D]`` final-normed hidden states (the compute dtype).
        kernel: ``[D, V]`` output projection, or ``[V, D]`` with ``transposed=True`` (a
            tied embedding table).
        targets: ``[...]`` integer ids in ``[0, V)``.
        transposed: whether ``kernel`` is ``[V, D]``.
        chunk_elements: at most this many logits exist at once (rounded to whole rows);
            above it, rows are processed in chunks.

    Returns:
        ``(nll, correct)``: float32 ``[...]`` and bool ``[...]`` (target is the first
        maximal logit). Only ``nll`` has a gradient, to ``hidden`` and ``kernel``.

    Raises:
        ValueError: for mismatched shapes or a non-positive ``chunk_elements``.

    Example:
        >>> h = jnp.ones((2, 3, 4)); w = jnp.zeros((4, 5))
        >>> nll, correct = head_cross_entropy(h, w, jnp.zeros((2, 3), jnp.int32))
        >>> round(float(nll[0, 0]), 4), bool(correct[0, 0])   # uniform: log 5, argmax 0
        (1.6094, True)
    """
    features = kernel.shape[1] if transposed else kernel.shape[0]
    vocab = kernel.shape[0] if transposed else kernel.shape[1]
    if kernel.ndim != 2 or hidden.shape[-1] != features:
        raise ValueError(
            f"hidden has shape {hidden.shape} and kernel {kernel.shape} (transposed="
            f"{transposed}); expected hidden [..., D] and kernel "
            f"{'[V, D]' if transposed else '[D, V]'} with the same D"
        )
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(
            f"targets has shape {targets.shape}; expected hidden's leading shape "
            f"{hidden.shape[:-1]}"
        )
    if chunk_elements < 1:
        raise ValueError(f"chunk_elements is {chunk_elements}; expected a positive int")
    lead = targets.shape
    count = math.prod(lead)
    flat = hidden.reshape(count, features)
    ids = targets.reshape(count).astype(jnp.int32)
    rows = max(1, min(count, chunk_elements // vocab))
    chunks = -(-count // rows)
    pad = chunks * rows - count
    if pad:
        flat = jnp.pad(flat, ((0, pad), (0, 0)))
        ids = jnp.pad(ids, (0, pad))
    if transposed and flat.dtype == jnp.bfloat16:
        # [N, D] @ [D, V] runs on bfloat16 kernels only with a row-major [D, V] operand
        # (`layout`): copy the table once, not once per chunk; its gradient flows back
        # through the copy unrounded.
        kernel, transposed = row_major_transpose(kernel), False
    nll, correct = _fused(
        flat.reshape(chunks, rows, features), kernel, ids.reshape(chunks, rows), transposed
    )
    return nll.reshape(-1)[:count].reshape(lead), correct.reshape(-1)[:count].reshape(lead)


def _logits(hidden: jax.Array, kernel: jax.Array, transposed: bool) -> jax.Array:
    weights = kernel.astype(hidden.dtype)
    contract = ((1,), (1,)) if transposed else ((1,), (0,))
    return jax.lax.dot_general(
        hidden, weights, (contract, ((), ())), preferred_element_type=jnp.float32
    )


def _chunk_forward(hidden, kernel, ids, transposed):
    logits = _logits(hidden, kernel, transposed)
    vocab = logits.shape[-1]
    peak = jnp.max(logits, axis=-1)
    normalizer = peak + jnp.log(jnp.sum(jnp.exp(logits - peak[:, None]), axis=-1))
    target = jnp.take_along_axis(logits, ids[:, None], axis=-1)[:, 0]
    index = jnp.arange(vocab, dtype=jnp.int32)
    first = jnp.min(jnp.where(logits == peak[:, None], index, vocab), axis=-1)
    return normalizer - target, first == ids, normalizer


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _fused(hidden, kernel, ids, transposed):
    nll, correct, _ = _forward(hidden, kernel, ids, transposed)
    return nll, correct


def _forward(hidden, kernel, ids, transposed):
    if hidden.shape[0] == 1:
        nll, correct, normalizer = _chunk_forward(hidden[0], kernel, ids[0], transposed)
        return nll[None], correct[None], normalizer[None]

    def step(_, chunk):
        return None, _chunk_forward(chunk[0], kernel, chunk[1], transposed)

    return jax.lax.scan(step, None, (hidden, ids))[1]


def _fused_fwd(hidden, kernel, ids, transposed):
    nll, correct, normalizer = _forward(hidden, kernel, ids, transposed)
    return (nll, correct), (hidden, kernel, ids, normalizer)


def _chunk_backward(hidden, kernel, rows_kernel, ids, normalizer, d_nll, transposed):
    """One chunk's gradients; ``rows_kernel`` is bfloat16 compute's ``[V, D]`` copy."""
    logits = _logits(hidden, kernel, transposed)
    index = jnp.arange(logits.shape[-1], dtype=jnp.int32)
    probs = jnp.exp(logits - normalizer[:, None])
    d_logits = ((probs - (index == ids[:, None])) * d_nll[:, None]).astype(hidden.dtype)
    weights = kernel.astype(hidden.dtype)
    if hidden.dtype == jnp.bfloat16:  # row-major [M, K] @ [K, N] products (`layout`)
        d_hidden = jnp.dot(d_logits, rows_kernel, preferred_element_type=jnp.float32)
        d_kernel = weight_gradient(hidden, d_logits)
    elif transposed:  # kernel [V, D]
        d_hidden = jnp.dot(d_logits, weights, preferred_element_type=jnp.float32)
        d_kernel = jnp.dot(d_logits.T, hidden, preferred_element_type=jnp.float32)
    else:  # kernel [D, V]
        d_hidden = jnp.einsum("nv,dv->nd", d_logits, weights, preferred_element_type=jnp.float32)
        d_kernel = jnp.dot(hidden.T, d_logits, preferred_element_type=jnp.float32)
    return d_hidden.astype(hidden.dtype), d_kernel


def _fused_bwd(transposed, residuals, cotangents):
    hidden, kernel, ids, normalizer = residuals
    d_nll = cotangents[0].astype(jnp.float32)
    rows_kernel = None
    if hidden.dtype == jnp.bfloat16:  # a tied table arrives [D, V] (`head_cross_entropy`)
        rows_kernel = row_major_transpose(kernel.astype(hidden.dtype))
    if hidden.shape[0] == 1:
        d_hidden, d_kernel = _chunk_backward(
            hidden[0], kernel, rows_kernel, ids[0], normalizer[0], d_nll[0], transposed
        )
        d_hidden = d_hidden[None]
    else:

        def step(total, chunk):
            rows, chunk_ids, chunk_normalizer, chunk_d_nll = chunk
            d_hidden, d_kernel = _chunk_backward(
                rows, kernel, rows_kernel, chunk_ids, chunk_normalizer, chunk_d_nll, transposed
            )
            return total + d_kernel, d_hidden

        zero = jnp.zeros(kernel.shape, jnp.float32)
        d_kernel, d_hidden = jax.lax.scan(step, zero, (hidden, ids, normalizer, d_nll))
    return d_hidden, d_kernel.astype(kernel.dtype), None


_fused.defvjp(_fused_fwd, _fused_bwd)
