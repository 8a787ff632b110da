"""Grouped-query self-attention for training, with a hand-written backward pass.

`self_attend` is the decoder's attention when there is no cache (training, scoring,
evaluation): one key/value part, masked by ``[B, S, S]``. It computes what
`dew_pipe.models.attention.attend` computes for a single part, but arranged for XLA's CPU
backend, where the autodiff version spent most of its time moving ``[S, S]`` tensors:

- Layout: queries are regrouped once to ``[B, K, G * S, D]`` (the G query heads sharing a
  key/value head stacked along the rows), keys and values to ``[B, K, T, D]``. Every
  contraction then has the batch axes leading and the ``[G * S, T]`` scores as one
  contiguous matrix per (row, key head), so no score-sized tensor is ever transposed.
- Memory: the forward keeps only the output and two float32 row statistics (the running
  maximum and the reciprocal of the softmax denominator); the backward recomputes the
  probabilities from the scores (one extra ``[G * S, D] x [D, T]`` matmul per head) rather
  than storing them. The score-sized tensors an autodiff backward keeps alive per layer
  are what made the CPU backend fault in fresh pages every step.
- Backward: the standard softmax identity ``dS = P * (dP - rowsum(dO * O))`` replaces
  differentiating through max/exp/sum, and masked scores get an exact zero gradient
  (as a ``where`` would), which also covers rows that attend nothing.

Numerics match `attend` (float32 scores and softmax; matmul inputs in the query's
dtype), to float32 rounding.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dew_pipe.models.layout import row_major_transpose

__all__ = ["self_attend"]

_MASKED = -1e30  # the same finite fill as `attention.attend`: empty rows average uniformly


def self_attend(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    mask: jax.Array,
    *,
    causal: bool = False,
    blocks: int | None = None,
) -> jax.Array:
    """Masked grouped-query attention of a sequence on itself.

    The queries may also be some positions of the sequence only (``S`` of its ``T``): the
    last block of ``features(columns=)`` computes the sampled columns' queries alone.

    Args:
        query: ``[B, S, H, D]``, already rotated and scaled by ``D ** -0.5``.
        key: ``[B, T, K, D]`` rotated keys; ``K`` divides ``H``; ``T >= S`` when causal.
        value: ``[B, T, K, D]``.
        mask: ``[B, S, T]`` bool, True where query i may attend key j.
        causal: promise that ``mask[:, i, j]`` is False whenever ``j > T - S + i`` (with
            ``T == S``: whenever ``j > i``); then each block of queries skips the keys after
            its last one's bound (``(n + 1) / 2n`` of the score entries for n blocks when
            ``T == S``: 62.5% at four). Queries at strictly increasing positions of the
            sequence keep the promise under a causal mask, since the i-th of S such
            positions is at most ``T - S + i``. Results are the same as without the promise
            for every query that attends something.
        blocks: query blocks for ``causal``; None picks the most of 8, 4, 2 or 1 that divide
            ``S`` into blocks of at least 48 queries.

    Returns:
        ``[B, S, H, D]`` in the query's dtype. A query whose mask row is all False (padding)
        gets a finite average of values and passes no gradient to the scores.

    Raises:
        ValueError: for ``blocks`` that do not divide ``S``, or shapes that disagree.

    Example:
        >>> q = jnp.ones((1, 3, 4, 8)); kv = jnp.ones((1, 3, 2, 8))
        >>> mask = jnp.tril(jnp.ones((3, 3), bool))[None]
        >>> self_attend(q, kv, kv, mask, causal=True).shape
        (1, 3, 4, 8)
    """
    batch, length, heads, dim = query.shape
    span, kv_heads = key.shape[1:3]
    if mask.shape != (batch, length, span) or value.shape != key.shape:
        raise ValueError(
            f"query {query.shape}, key {key.shape}, value {value.shape} and mask "
            f"{mask.shape}; expected [B, S, H, D], [B, T, K, D] twice and [B, S, T]"
        )
    if causal and span < length:
        raise ValueError(
            f"causal attention needs at least as many keys as queries; got {span} and {length}"
        )
    group = heads // kv_heads
    if not causal:
        blocks = 1
    elif blocks is None:
        blocks = next(n for n in (8, 4, 2, 1) if length % n == 0 and length // n >= 48 or n == 1)
    if blocks < 1 or length % blocks:
        raise ValueError(f"blocks is {blocks}; expected a positive divisor of the length {length}")
    # Rows ordered (position, group): a block of positions is a contiguous run of rows.
    rows = query.reshape(batch, length, kv_heads, group, dim).transpose(0, 2, 1, 3, 4)
    rows = rows.reshape(batch, kv_heads, length * group, dim)
    keys, values = key.transpose(0, 2, 1, 3), value.transpose(0, 2, 1, 3)
    out = _attend(rows, keys, values, mask, blocks)
    out = out.reshape(batch, kv_heads, length, group, dim).transpose(0, 2, 1, 3, 4)
    return out.reshape(batch, length, heads, dim)


def _spans(length: int, blocks: int, keys: int) -> list[tuple[int, int, int]]:
    """Per query block: its first query, the one after its last, and the keys it sees.

    A single block sees every key; causal blocks see the keys up to their last query's
    bound, ``keys - length + end`` (the queries are the last ``length`` of ``keys``
    positions, or positions no later than those).
    """
    if blocks == 1:
        return [(0, length, keys)]
    size = length // blocks
    return [(i * size, (i + 1) * size, keys - length + (i + 1) * size) for i in range(blocks)]


def _scores(rows: jax.Array, keys: jax.Array, mask: jax.Array) -> jax.Array:
    """Masked float32 scores ``[B, K, S' * G, T']`` of a block (mask ``[B, S', T']``)."""
    batch, kv_heads, grouped, _ = rows.shape
    length, span = mask.shape[1:]
    scores = jnp.einsum("bkmd,bktd->bkmt", rows, keys, preferred_element_type=jnp.float32)
    scores = scores.reshape(batch, kv_heads, length, grouped // length, span)
    scores = jnp.where(mask[:, None, :, None, :], scores, _MASKED)
    return scores.reshape(batch, kv_heads, grouped, span)


def _block(x: jax.Array, start: int, end: int, group: int) -> jax.Array:
    return x[:, :, start * group : end * group]


def _forward(rows, keys, values, mask, blocks):
    group = rows.shape[2] // mask.shape[1]
    outs, peaks, scales = [], [], []
    for start, end, seen in _spans(mask.shape[1], blocks, keys.shape[2]):
        scores = _scores(
            _block(rows, start, end, group), keys[:, :, :seen], mask[:, start:end, :seen]
        )
        peak = jnp.max(scores, axis=-1, keepdims=True)
        weights = jnp.exp(scores - peak)
        scale = 1.0 / jnp.sum(weights, axis=-1, keepdims=True)
        probs = (weights * scale).astype(values.dtype)
        out = jnp.einsum(
            "bkmt,bktd->bkmd", probs, values[:, :, :seen], preferred_element_type=jnp.float32
        )
        outs.append(out.astype(rows.dtype))
        peaks.append(peak)
        scales.append(scale)
    join = lambda parts: parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=2)  # noqa: E731
    return join(outs), join(peaks), join(scales)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attend(rows, keys, values, mask, blocks):
    return _forward(rows, keys, values, mask, blocks)[0]


def _attend_fwd(rows, keys, values, mask, blocks):
    out, peak, scale = _forward(rows, keys, values, mask, blocks)
    return out, (rows, keys, values, mask, out, peak, scale)


def _attend_bwd(blocks, residuals, d_out):
    rows, keys, values, mask, out, peak, scale = residuals
    dtype = rows.dtype
    length = mask.shape[1]
    group = rows.shape[2] // length
    # rowsum(dO * O) is rowsum(P * dP), the softmax Jacobian's correction term.
    correction = jnp.sum(
        d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True
    )
    d_rows, d_keys, d_values = [], [], []
    for start, end, seen in _spans(length, blocks, keys.shape[2]):
        block = functools.partial(_block, start=start, end=end, group=group)
        block_rows, block_d_out = block(rows), block(d_out)
        block_keys, block_values = keys[:, :, :seen], values[:, :, :seen]
        block_mask = mask[:, start:end, :seen]
        probs = jnp.exp(_scores(block_rows, block_keys, block_mask) - block(peak)) * block(scale)
        d_probs = jnp.einsum(
            "bkmd,bktd->bkmt", block_d_out, block_values, preferred_element_type=jnp.float32
        )
        batch, kv_heads, grouped, span = d_probs.shape
        d_scores = (probs * (d_probs - block(correction))).reshape(
            batch, kv_heads, end - start, group, span
        )
        d_scores = jnp.where(block_mask[:, None, :, None, :], d_scores, 0.0)
        d_scores = d_scores.reshape(d_probs.shape).astype(dtype)
        d_rows.append(
            jnp.einsum("bkmt,bktd->bkmd", d_scores, block_keys, preferred_element_type=jnp.float32)
        )
        d_keys.append(_contract_rows(block_rows, d_scores))
        d_values.append(_contract_rows(block_d_out, probs.astype(dtype)))
    d_rows = d_rows[0] if len(d_rows) == 1 else jnp.concatenate(d_rows, axis=2)
    return (
        d_rows.astype(dtype),
        _sum_prefixes(d_keys, keys.shape[2]).astype(keys.dtype),
        _sum_prefixes(d_values, values.shape[2]).astype(values.dtype),
        None,
    )


def _sum_prefixes(parts: list[jax.Array], span: int) -> jax.Array:
    """Sums ``[B, K, T_i, D]`` gradients of key prefixes into one ``[B, K, span, D]``."""
    pad = lambda part: jnp.pad(part, ((0, 0), (0, 0), (0, span - part.shape[2]), (0, 0)))  # noqa: E731
    total = pad(parts[0])
    for part in parts[1:]:
        total = total + pad(part)
    return total


_attend.defvjp(_attend_fwd, _attend_bwd)


def _contract_rows(small: jax.Array, scores: jax.Array) -> jax.Array:
    """``einsum("bkmd,bkmt->bktd")``: a sum over the score rows, computed as ``small^T @ scores``.

    Written directly, the contraction runs over the first axis of both matrices, a form the
    CPU backend hands to a generic (Eigen) kernel at a third of the speed of its regular
    matmul. Transposing the small ``[M, D]`` operand first makes it a plain
    ``[D, M] x [M, T]`` product; only the small ``[D, T]`` result is transposed back. The
    barriers keep both transposes as arrays of their own: without them XLA folds them back
    into the contraction (the one on the result by swapping the operands), and the product
    is the slow form again. In bfloat16 even the barrier leaves the transpose a layout
    change, and XLA widens the product to float32 (33 against 75 GFLOP/s at
    ``[8, 4, 512, 32]`` by ``[8, 4, 512, 256]`` on a Zen 4 core): there the transpose is a
    row-major copy (`dew_pipe.models.layout.row_major_transpose`).
    """
    if small.dtype == jnp.bfloat16:  # a barrier on the transpose alone is not enough here
        flipped = row_major_transpose(small)
    else:
        flipped = jax.lax.optimization_barrier(jnp.swapaxes(small, -1, -2))
    out = jnp.einsum("bkdm,bkmt->bkdt", flipped, scores, preferred_element_type=jnp.float32)
    return jnp.swapaxes(jax.lax.optimization_barrier(out), -1, -2)
