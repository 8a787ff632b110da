"""Pure attention pieces of the decoder: rotary embedding, masks and grouped attention.

These are plain functions on arrays so that they can be swapped or tuned one at a time.

Strategy:
- Masks are boolean and computed once per forward pass (outside the layer scan), then
  broadcast to every layer and head.
- Grouped-query attention never repeats keys and values: queries are viewed as
  ``[B, S, K, G, D]`` (K key/value heads, G query heads per key head) and contracted
  against ``[B, T, K, D]`` keys directly.
- Attention may span several key/value *parts* with one joint softmax. The cached path uses
  two: the cache as it was before this call, and the keys computed in this call. So the
  cache is never concatenated or copied inside the layer loop, and the new entries are
  written into it once, after the loop.
- Masked scores get a large negative finite value rather than ``-inf``: a query with
  nothing to attend (a padding token) then averages uniformly instead of producing NaN,
  which would poison gradients even where the loss ignores that token.
- A single query per row (a decode step) is contracted against all key/value heads at
  once, with the row as the only batch axis, and each head keeps its own block. The
  per-head contraction would make XLA copy a transposed ``[B, K, T, D]`` version of each
  layer's cache first (batch axes must lead), which dominated a small model's CPU decode
  step; the block form reads the cache in place for K times the (tiny) score arithmetic.
  ``benchmarks/generate.py`` records the effect.
- The compiled decode loop (`dew_pipe.inference.decoding`) goes further: it keeps its cache
  head-major, keys ``[B, K, D, T]`` and values ``[B, K, T, D]``, so `attend_step`
  contracts each head against its own entries with ``(B, K)`` as the batch axes, which are
  already leading, and each product in the plain ``[G, D] x [D, T]`` and ``[G, T] x
  [T, D]`` forms. That reads the cache once, in place, with none of the block form's
  K-fold arithmetic. (Keys as ``[B, K, T, D]`` made the score product about 2.7x slower
  than keys as ``[B, K, D, T]`` at 128 rows: XLA's CPU matmul transposes an operand whose
  contracted axis is its last.)
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

__all__ = [
    "apply_rotary",
    "attend",
    "attend_step",
    "cache_mask",
    "causal_segment_mask",
    "rotary_angles",
    "rotary_angles_once",
]

_MASKED = -1e30


def rotary_angles(positions: jax.Array, inv_freq: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """Cosine and sine of the rotary angles, float32 ``[B, S, head_dim // 2]``.

    Args:
        positions: ``[B, S]`` integer positions.
        inv_freq: ``[head_dim // 2]`` float32 inverse frequencies.

    Returns:
        ``(cos, sin)``.
    """
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles), jnp.sin(angles)


def rotary_angles_once(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`rotary_angles`, computed into buffers of their own for a pass with many rotations.

    XLA's CPU backend fuses the cosine and sine into every fusion that reads them, and a
    fusion evaluates its producers once per output element: each rotation of ``[B, S, H,
    head_dim]`` queries or keys (every layer, forward and backward) would recompute both
    ``2 * H`` times over, which cost more than the rotations themselves. Control flow is
    a fusion boundary JAX can express, so the angles come out of a conditional whose
    predicate (every position above the int32 minimum) always holds.
    """
    always = jnp.all(positions > jnp.iinfo(jnp.int32).min)

    def never(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
        zeros = jnp.zeros((*positions.shape, inv_freq.shape[-1]), jnp.float32)
        return zeros, zeros

    return jax.lax.cond(always, rotary_angles, never, positions, inv_freq)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates ``x`` ``[B, S, heads, D]`` by the angles, in transformers' rotate-half layout.

    The first and second halves of each head are the two coordinates of each rotated pair,
    so Hugging Face q/k projection weights load without any permutation.
    """
    half = x.shape[-1] // 2
    cos = cos[:, :, None, :].astype(jnp.float32)
    sin = sin[:, :, None, :].astype(jnp.float32)
    x32 = x.astype(jnp.float32)
    first, second = x32[..., :half], x32[..., half:]
    out = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return out.astype(x.dtype)


def causal_segment_mask(
    segment_ids: jax.Array, prefix_segments: jax.Array | None = None
) -> jax.Array:
    """``[B, S, S]`` bool: query i may see key j when j ≤ i and both share a segment > 0.

    With ``prefix_segments`` ``[B, S]``, query i may also see the keys (j ≤ i) of segment
    ``prefix_segments[i]`` when that is > 0: the shared prompt that i's segment continues
    (rows packed with ``pack(..., share_prompts=True)``).
    """
    length = segment_ids.shape[1]
    causal = jnp.tril(jnp.ones((length, length), dtype=bool))
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    if prefix_segments is not None:
        shared = prefix_segments[:, :, None] == segment_ids[:, None, :]
        same = same | (shared & (prefix_segments > 0)[:, :, None])
    return same & causal[None] & (segment_ids > 0)[:, :, None]


def cache_mask(
    cache_positions: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array,
    cache_index: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Masks of a cached call over the old cache and over this call's own tokens.

    A query sees every filled slot (position ≥ 0) whose position is ≤ its own. Slots this
    call is about to overwrite, ``[index_b, index_b + S)``, are excluded from the old part,
    since the new tokens replace them; the new tokens themselves are visible to each other
    by the same position rule, padding (segment 0) excluded.

    Args:
        cache_positions: ``[B, T]`` int32 positions stored in the cache (−1 empty).
        positions: ``[B, S]`` int32 positions of the new tokens.
        segment_ids: ``[B, S]`` int32; 0 marks padding.
        cache_index: ``[B]`` int32 write offset of each row.

    Returns:
        ``(old [B, S, T], new [B, S, S])`` boolean masks.
    """
    length = positions.shape[1]
    slots = jnp.arange(cache_positions.shape[1])[None, :]
    start = cache_index[:, None]
    overwritten = (slots >= start) & (slots < start + length)
    usable = (cache_positions >= 0) & ~overwritten
    old = usable[:, None, :] & (cache_positions[:, None, :] <= positions[:, :, None])
    new = (segment_ids > 0)[:, None, :] & (positions[:, None, :] <= positions[:, :, None])
    return old, new


def attend(
    query: jax.Array,
    parts: Sequence[tuple[jax.Array, jax.Array, jax.Array]],
) -> jax.Array:
    """Grouped-query attention over one or more key/value parts with a joint softmax.

    Args:
        query: ``[B, S, H, D]``, already scaled by ``D ** -0.5`` and rotated.
        parts: ``(key [B, T, K, D], value [B, T, K, D], mask [B, S, T] bool)`` triples;
            ``K`` divides ``H``.

    Returns:
        ``[B, S, H, D]`` in the query's dtype. Scores and the softmax are float32.
    """
    batch, length, heads, dim = query.shape
    kv_heads = parts[0][0].shape[2]
    grouped = query.reshape(batch, length, kv_heads, heads // kv_heads, dim)
    scores = []
    for key, _, mask in parts:
        scores.append(jnp.where(mask[:, None, None], _scores(grouped, key), _MASKED))
    probs = jax.nn.softmax(jnp.concatenate(scores, axis=-1) if len(scores) > 1 else scores[0])
    probs = probs.astype(query.dtype)
    out = None
    offset = 0
    for key, value, _ in parts:
        span = key.shape[1]
        piece = _weighted(probs[..., offset : offset + span], value)
        out = piece if out is None else out + piece
        offset += span
    return out.reshape(batch, length, heads, dim)


def attend_step(
    query: jax.Array,
    cached: tuple[jax.Array, jax.Array, jax.Array],
    new: tuple[jax.Array, jax.Array, jax.Array],
) -> jax.Array:
    """One query per row against a head-major cache and the row's own new entry.

    The same result as ``attend(query, [cached, new])`` with the cache in ``[B, T, K, D]``
    (up to float32 summation order), one softmax over both parts.

    Args:
        query: ``[B, 1, H, D]``, already scaled by ``D ** -0.5`` and rotated.
        cached: ``(key [B, K, D, T], value [B, K, T, D], mask [B, 1, T] bool)``.
        new: ``(key [B, 1, K, D], value [B, 1, K, D], mask [B, 1, 1] bool)``: the entry of
            the id this step feeds.

    Returns:
        ``[B, 1, H, D]`` in the query's dtype.
    """
    batch, length, heads, dim = query.shape
    key, value, mask = cached
    new_key, new_value, new_mask = new
    kv_heads = key.shape[1]
    if length != 1 or new_key.shape[1] != 1:
        raise ValueError(
            f"attend_step takes one query and one new entry per row; got query {query.shape} "
            f"and new key {new_key.shape}"
        )
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, dim)
    old = jnp.einsum("bkgd,bkdt->bkgt", grouped, key, preferred_element_type=jnp.float32)
    own = jnp.einsum("bkgd,bkd->bkg", grouped, new_key[:, 0], preferred_element_type=jnp.float32)
    scores = jnp.concatenate(
        [
            jnp.where(mask[:, None], old, _MASKED),
            jnp.where(new_mask[:, None], own[..., None], _MASKED),
        ],
        axis=-1,
    )
    probs = jax.nn.softmax(scores).astype(query.dtype)
    span = key.shape[3]
    out = jnp.einsum(
        "bkgt,bktd->bkgd", probs[..., :span], value, preferred_element_type=jnp.float32
    ).astype(value.dtype)
    own_out = (
        probs[..., span:].astype(jnp.float32) * new_value[:, 0, :, None].astype(jnp.float32)
    ).astype(new_value.dtype)
    return (out + own_out).reshape(batch, 1, heads, dim)


def _scores(grouped: jax.Array, key: jax.Array) -> jax.Array:
    """Float32 scores ``[B, K, G, S, T]`` of queries ``[B, S, K, G, D]`` on keys ``[B, T, K, D]``."""
    batch, length, kv_heads, group, dim = grouped.shape
    if length != 1:
        return jnp.einsum("bskgd,btkd->bkgst", grouped, key, preferred_element_type=jnp.float32)
    # Decode: q[b, (k, g), (k', d)] is zero unless k' == k, so one matmul over (k', d)
    # gives every head its own scores (see the module docstring).
    eye = jnp.eye(kv_heads, dtype=grouped.dtype)[:, None, :, None]
    blocks = (grouped[:, 0, :, :, None, :] * eye).reshape(batch, kv_heads * group, -1)
    flat = key.reshape(batch, key.shape[1], kv_heads * dim)
    score = jnp.einsum("bqc,btc->bqt", blocks, flat, preferred_element_type=jnp.float32)
    return score.reshape(batch, kv_heads, group, 1, key.shape[1])


def _weighted(probs: jax.Array, value: jax.Array) -> jax.Array:
    """``[B, S, K, G, D]``: probabilities ``[B, K, G, S, T]`` times values ``[B, T, K, D]``."""
    batch, kv_heads, group, length, span = probs.shape
    if length != 1:
        out = jnp.einsum("bkgst,btkd->bskgd", probs, value, preferred_element_type=jnp.float32)
        return out.astype(value.dtype)
    # Decode: weight every head's values, then keep each query head's own block.
    flat = value.reshape(batch, span, -1)
    mixed = jnp.einsum(
        "bqt,btc->bqc",
        probs.reshape(batch, kv_heads * group, span),
        flat,
        preferred_element_type=jnp.float32,
    )
    mixed = mixed.reshape(batch, kv_heads, group, kv_heads, -1)
    eye = jnp.eye(kv_heads, dtype=mixed.dtype)[:, None, :, None]
    return jnp.sum(mixed * eye, axis=3)[:, None].astype(value.dtype)
