"""Causal decoder of the Llama/Qwen3 family as a Flax linen module.

`CausalTransformer` takes packed rows (``segment_ids`` keep attention inside each document,
``positions`` restart per document) and decodes with a per-row key/value cache.

Layout choices, for speed and compile time:
- The blocks run under ``nn.scan``: one block is traced and compiled once whatever
  ``num_layers`` is, and every block parameter is stacked on a leading layer axis
  (``params["layers"]["attn"]["q"]`` is ``[L, D, H * head_dim]``).
- Every projection is a 2-D matmul on ``[B * S, features]``; matrices are stored
  ``[in, out]``.
- Masks and rotary angles are computed once per call, outside the layer scan.

Parameters (``L`` layers, ``D`` emb_features, ``H``/``K`` query/key heads, ``d`` head_dim,
``F`` mlp_features, ``V`` vocab_size)::

    embed [V, D]
    layers/attn_norm/scale [L, D]      layers/mlp_norm/scale [L, D]
    layers/attn/q [L, D, H*d]   k, v [L, D, K*d]   o [L, H*d, D]
    layers/attn/q_norm/scale, k_norm/scale [L, d]   (qk_norm only)
    layers/mlp/gate, up [L, D, F]   down [L, F, D]
    final_norm/scale [D]
    lm_head [D, V]                                   (untied only)
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dew_pipe.models import attention, checks
from dew_pipe.models.config import TransformerConfig
from dew_pipe.models.cross_entropy import head_cross_entropy
from dew_pipe.models.layout import row_major_transpose, weight_gradient
from dew_pipe.models.self_attention import self_attend

__all__ = ["CausalTransformer", "Cache"]

Cache = dict[str, jax.Array]
"""``{"key": [L, B, T, K, d], "value": [L, B, T, K, d], "positions": [B, T] int32}``."""


def matmul_dtype(x: Any, kernel: Any) -> Any:
    """The dtype a matmul of ``x`` by ``kernel`` reads both in: the narrower of the two.

    A model computing in ``dtype`` with wider parameters (bfloat16 compute, float32
    weights) multiplies in ``dtype``; one with narrower parameters (float32 activations,
    bfloat16 weights, as a CPU server keeps them) multiplies in the parameters' dtype, so
    the weights are read as stored and never widened.
    """
    x, kernel = jnp.dtype(x), jnp.dtype(kernel)
    return kernel if kernel.itemsize < x.itemsize else x


def dense(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """``x [..., in] @ kernel [in, out]`` as one 2-D matmul, the result in ``x``'s dtype.

    Both inputs are read in `matmul_dtype` and the product accumulates in float32 (see
    `matmul`). Float32 inputs are unchanged.
    """
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1]).astype(matmul_dtype(x.dtype, kernel.dtype))
    return matmul(flat, kernel).astype(x.dtype).reshape(*lead, kernel.shape[-1])


def matmul(flat: jax.Array, kernel: jax.Array) -> jax.Array:
    """``flat [N, in] @ kernel [in, out]`` in ``flat``'s dtype with a float32 result.

    The kernel is read in ``flat``'s dtype; its gradient comes back in its own dtype. XLA's
    CPU backend runs a bfloat16 matmul with a float32 result on its bfloat16 kernels (about
    3x a float32 one at decode shapes on CPUs with AVX512-BF16 or AMX), and one with a
    bfloat16 result on a slow generic path. Each backward product gets operands that
    those kernels take (`_bf16_dot`, `_narrowing_dot`).
    """
    if flat.dtype == jnp.bfloat16:
        return _bf16_dot(flat, kernel)
    kernel = kernel.astype(flat.dtype)
    if flat.dtype == jnp.float32 and kernel.shape[0] > kernel.shape[1]:
        return _narrowing_dot(flat, kernel)
    return jnp.dot(flat, kernel, preferred_element_type=jnp.float32)


@jax.custom_vjp
def _narrowing_dot(flat: jax.Array, kernel: jax.Array) -> jax.Array:
    """Float32 ``flat [N, in] @ kernel [in, out]`` for ``in > out``, with its own weight gradient.

    The kernel's gradient ``flat^T @ d_out`` contracts the first axis of both operands,
    which XLA's CPU backend runs on Eigen's generic kernel; with the wide ``[N, in]``
    operand on the left (a SwiGLU down projection, in = 4 x out) that ran at half the
    rate of the same product with the operands swapped, ``(d_out^T @ flat)^T``: 53
    against 100 GFLOP/s at 4224 x 512 x 128 on a Zen 4 core. The barrier keeps the small
    ``[out, in]`` result's transpose as an array of its own; without it XLA folds the
    transpose back by swapping the operands again.
    """
    return jnp.dot(flat, kernel, preferred_element_type=jnp.float32)


def _narrowing_dot_fwd(flat: jax.Array, kernel: jax.Array):
    return _narrowing_dot(flat, kernel), (flat, kernel)


def _narrowing_dot_bwd(residuals: tuple[jax.Array, jax.Array], d_out: jax.Array):
    flat, kernel = residuals
    d_flat = jnp.dot(d_out, kernel.T, preferred_element_type=jnp.float32)
    d_kernel = jnp.einsum("no,ni->oi", d_out, flat, preferred_element_type=jnp.float32)
    return d_flat, jax.lax.optimization_barrier(d_kernel).T


_narrowing_dot.defvjp(_narrowing_dot_fwd, _narrowing_dot_bwd)


@jax.custom_vjp
def _bf16_dot(flat: jax.Array, kernel: jax.Array) -> jax.Array:
    """bfloat16 ``flat [N, in] @ kernel [in, out]`` (the kernel rounded to bfloat16), float32.

    XLA's CPU backend widens a bfloat16 matmul to float32 unless both operands are
    row-major and contracted as ``[N, in] @ [in, out]``, and autodiff's backward products
    are not: ``d_out @ kernel^T`` and ``flat^T @ d_out`` would run at the float32 rate or
    below (86 and 50-90 GFLOP/s on a Zen 4 core against 180 for the forward product).
    The backward pass here transposes one operand of each into a row-major copy first
    (`row_major_transpose`): the narrower one of the kernel product, so the copy is
    cheap. The cotangent is rounded to bfloat16; ``flat``'s gradient comes back in
    bfloat16, the kernel's unrounded, in its own dtype.
    """
    return jnp.dot(flat, kernel.astype(flat.dtype), preferred_element_type=jnp.float32)


def _bf16_dot_fwd(flat: jax.Array, kernel: jax.Array):
    return _bf16_dot(flat, kernel), (flat, kernel)


def _bf16_dot_bwd(residuals: tuple[jax.Array, jax.Array], d_out: jax.Array):
    flat, kernel = residuals
    d_out = d_out.astype(flat.dtype)
    weights = row_major_transpose(kernel.astype(flat.dtype))
    d_flat = jnp.dot(d_out, weights, preferred_element_type=jnp.float32)
    d_kernel = weight_gradient(flat, d_out)
    return d_flat.astype(flat.dtype), d_kernel.astype(kernel.dtype)


_bf16_dot.defvjp(_bf16_dot_fwd, _bf16_dot_bwd)


@jax.custom_vjp
def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """``silu(gate) * up``, keeping only its two inputs for the backward pass.

    Autodiff of the same expression keeps the sigmoid, the silu and partial products alive
    until the backward pass (several ``[tokens, mlp_features]`` buffers per layer, the
    largest activations of a small model); this computes both input gradients from
    ``gate`` and ``up`` in one elementwise pass instead.
    """
    # silu in float32, rounded once to the compute dtype, then the product rounded once
    # (PyTorch's arithmetic on bfloat16 tensors); XLA's CPU backend would otherwise round
    # after every elementwise op of silu in bfloat16, and pay a convert pair for each.
    silu = jax.nn.silu(gate.astype(jnp.float32)).astype(gate.dtype)
    return (silu.astype(jnp.float32) * up.astype(jnp.float32)).astype(jnp.result_type(gate, up))


def _swiglu_fwd(gate: jax.Array, up: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    return swiglu(gate, up), (gate, up)


def _swiglu_bwd(residuals: tuple[jax.Array, jax.Array], d_out: jax.Array):
    gate, up = residuals
    sig = jax.nn.sigmoid(gate.astype(jnp.float32))
    g32 = gate.astype(jnp.float32)
    d32 = d_out.astype(jnp.float32)
    d_up = d32 * g32 * sig
    d_gate = d32 * up.astype(jnp.float32) * sig * (1.0 + g32 * (1.0 - sig))
    return d_gate.astype(gate.dtype), d_up.astype(up.dtype)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last axis, computed in float32 (as transformers)."""

    features: int
    eps: float
    dtype: Any
    param_dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones, (self.features,), self.param_dtype)
        return rms_norm(x, scale, self.eps, self.dtype)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, dtype: Any) -> jax.Array:
    """`RMSNorm`'s arithmetic on a given ``scale``: normalized in float32, scaled in ``dtype``.

    In a narrower compute dtype than float32 the backward pass is written out in float32
    from ``x`` and the saved inverse norm (`_narrow_rms_norm`): the scale's gradient is a
    float32 sum of float32 products (autodiff would round each product to bfloat16 first,
    and XLA's CPU backend ran that sum as a slow windowed reduction), and ``x``'s gradient
    is rounded once, to ``x``'s dtype. Float32 compute keeps autodiff's arithmetic, so its
    gradients round exactly as they always have.
    """
    if jnp.dtype(dtype) == jnp.float32 and x.dtype == jnp.float32:
        return _rms_norm_fwd(x, scale, eps, dtype)[0]
    return _narrow_rms_norm(x, scale, eps, dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _narrow_rms_norm(x: jax.Array, scale: jax.Array, eps: float, dtype: Any) -> jax.Array:
    return _rms_norm_fwd(x, scale, eps, dtype)[0]


def _rms_norm_fwd(x: jax.Array, scale: jax.Array, eps: float, dtype: Any):
    x32 = x.astype(jnp.float32)
    inverse = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    out = (x32 * inverse).astype(dtype) * scale.astype(dtype)
    return out, (x, inverse, scale)


def _rms_norm_bwd(eps: float, dtype: Any, residuals, d_out: jax.Array):
    x, inverse, scale = residuals
    normed = x.astype(jnp.float32) * inverse
    d32 = d_out.astype(jnp.float32)
    # The forward scaled the normed values as rounded to ``dtype``, by the rounded scale.
    rounded = normed.astype(dtype).astype(jnp.float32)
    d_scale = jnp.sum((rounded * d32).reshape(-1, scale.shape[-1]), axis=0)
    d_normed = d32 * scale.astype(dtype).astype(jnp.float32)
    mean = jnp.mean(d_normed * normed, axis=-1, keepdims=True)
    d_x = inverse * (d_normed - normed * mean)
    return d_x.astype(x.dtype), d_scale.astype(scale.dtype)


_narrow_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


class Attention(nn.Module):
    """Grouped-query self-attention with rotary positions and optional q/k norm."""

    config: TransformerConfig

    @nn.compact
    def __call__(
        self, x: jax.Array, context: dict[str, jax.Array], layer_cache: Any
    ) -> tuple[jax.Array, Any]:
        cfg = self.config
        init = nn.initializers.normal(cfg.init_std)
        D, H, K, d = cfg.emb_features, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_w = self.param("q", init, (D, H * d), cfg.param_dtype)
        k_w = self.param("k", init, (D, K * d), cfg.param_dtype)
        v_w = self.param("v", init, (D, K * d), cfg.param_dtype)
        o_w = self.param("o", init, (H * d, D), cfg.param_dtype)
        batch, length = x.shape[:2]
        q = dense(x, q_w).reshape(batch, length, H, d)
        k = dense(x, k_w).reshape(batch, length, K, d)
        v = dense(x, v_w).reshape(batch, length, K, d)
        if cfg.qk_norm:
            norm = dict(features=d, eps=cfg.norm_eps, dtype=cfg.dtype, param_dtype=cfg.param_dtype)
            q = RMSNorm(**norm, name="q_norm")(q)
            k = RMSNorm(**norm, name="k_norm")(k)
        cos, sin = context["cos"], context["sin"]
        q = attention.apply_rotary(q, cos, sin) * jnp.asarray(d**-0.5, q.dtype)
        k = attention.apply_rotary(k, cos, sin)
        if layer_cache is None and "columns" in context:
            # Only some rows' queries are read (the last block under features(columns=)):
            # every key and value, the queries of those columns alone.
            # Columns that strictly increase keep self_attend's causal promise (the i-th of
            # K is at most S - K + i), so each block of their queries skips the later keys.
            columns = context["columns"]
            q = jnp.take_along_axis(q, columns[:, :, None, None], axis=1)
            mask = jnp.take_along_axis(context["mask"], columns[:, :, None], axis=1)
            causal = context.get("increasing", False)
            out = self_attend(q, k, v, mask, causal=causal).reshape(*columns.shape, H * d)
            return dense(out, o_w), None
        if layer_cache is None:
            # The mask comes from causal_segment_mask: causal, so key blocks can be skipped.
            out = self_attend(q, k, v, context["mask"], causal=True)
            out = out.reshape(batch, length, H * d)
            return dense(out, o_w), None
        # A cache may be kept in another dtype than the compute.
        cached_k, cached_v = (c.astype(q.dtype) for c in layer_cache)
        parts = [(cached_k, cached_v, context["cache_mask"]), (k, v, context["mask"])]
        out = attention.attend(q, parts).reshape(batch, length, H * d)
        return dense(out, o_w), (k, v)


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        init = nn.initializers.normal(cfg.init_std)
        D, F = cfg.emb_features, cfg.mlp_features
        gate = self.param("gate", init, (D, F), cfg.param_dtype)
        up = self.param("up", init, (D, F), cfg.param_dtype)
        down = self.param("down", init, (F, D), cfg.param_dtype)
        return dense(swiglu(dense(x, gate), dense(x, up)), down)


class Block(nn.Module):
    """Pre-norm decoder block; the scan body (carry: hidden states, x: this layer's cache)."""

    config: TransformerConfig

    @nn.compact
    def __call__(
        self, x: jax.Array, layer_cache: Any, context: dict[str, jax.Array]
    ) -> tuple[jax.Array, Any]:
        cfg = self.config
        norm = dict(
            features=cfg.emb_features,
            eps=cfg.norm_eps,
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
        )
        h, new_entries = Attention(cfg, name="attn")(
            RMSNorm(**norm, name="attn_norm")(x), context, layer_cache
        )
        if "columns" in context:  # the attention returned those columns only
            x = jnp.take_along_axis(x, context["columns"][:, :, None], axis=1)
        x = x + h
        x = x + MLP(cfg, name="mlp")(RMSNorm(**norm, name="mlp_norm")(x))
        return x, new_entries


class CausalTransformer(nn.Module):
    """Llama/Qwen3-style causal decoder; see the module docstring for the parameter layout.

    Call forms (``model.apply(variables, ...)``)::

        logits = model.apply(v, tokens, segment_ids=None, positions=None)   # [B,S,V] float32
        hidden = model.apply(v, tokens, segment_ids, positions, method="features")   # [B,S,D]
        logits = model.apply(v, hidden, method="logits")                     # head only
        cache = model.init_cache(batch, length)
        logits, cache = model.apply(v, tokens, segment_ids, positions,
                                    cache=cache, cache_index=index)

    ``segment_ids`` ``[B, S]`` int: 0 is padding, > 0 a document; a token attends to earlier
    tokens of its own document only (None: all ones). ``positions`` ``[B, S]`` int: rotary
    positions, restarting at 0 per document (None: ``arange(S)``, or ``cache_index + arange(S)``
    in a cached call).

    Cached calls: row b's S new keys/values go to slots ``[index_b, index_b + S)``; each slot
    also stores its token's position (−1 for padding and for empty slots), and a query attends
    to the filled slots whose position is ≤ its own. Left-padded prefill, rows at different
    offsets and one compiled shape per (B, S) therefore all work. A cached row holds one
    sequence: its ``segment_ids`` only tell real tokens (> 0) from padding. Entries that
    would land outside ``[0, length)`` are not stored (a compiled step cannot raise); callers
    keep ``index_b + S <= length``.

    Raises:
        TypeError / ValueError: tokens, segment_ids, positions, cache or cache_index of the
            wrong dtype or shape, or longer than ``max_seq_len`` (at trace time).

    Example:
        >>> from dew_pipe import models
        >>> model = models.build("causal_transformer", vocab_size=8, emb_features=16,
        ...                      num_layers=1, num_heads=2, mlp_features=32, max_seq_len=4)
        >>> tokens = jnp.zeros((1, 4), jnp.int32)
        >>> variables = model.init(jax.random.key(0), tokens)
        >>> model.apply(variables, tokens).shape
        (1, 4, 8)
    """

    config: TransformerConfig

    def setup(self) -> None:
        cfg = self.config
        dense = nn.initializers.normal(cfg.init_std)
        self.embed = self.param("embed", dense, (cfg.vocab_size, cfg.emb_features), cfg.param_dtype)
        if not cfg.tie_embeddings:
            self.lm_head = self.param(
                "lm_head", dense, (cfg.emb_features, cfg.vocab_size), cfg.param_dtype
            )
        block = Block
        if cfg.remat_policy is not None:
            block = nn.remat(block, policy=cfg.remat_policy, prevent_cse=False)
        self.layers = nn.scan(
            block,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=(0, nn.broadcast),
            length=cfg.num_layers,
            unroll=cfg.scan_unroll,
        )(cfg)
        self.final_norm = RMSNorm(
            cfg.emb_features, cfg.norm_eps, dtype=cfg.dtype, param_dtype=cfg.param_dtype
        )

    def __call__(
        self,
        tokens: jax.Array,
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
        *,
        cache: Cache | None = None,
        cache_index: jax.Array | None = None,
        prefix_segments: jax.Array | None = None,
    ) -> jax.Array | tuple[jax.Array, Cache]:
        """Logits ``[B, S, V]`` float32 (and the updated cache in a cached call)."""
        out = self.features(
            tokens,
            segment_ids,
            positions,
            cache=cache,
            cache_index=cache_index,
            prefix_segments=prefix_segments,
        )
        if cache is None:
            return self.logits(out)
        hidden, cache = out
        return self.logits(hidden), cache

    def features(
        self,
        tokens: jax.Array,
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
        *,
        cache: Cache | None = None,
        cache_index: jax.Array | None = None,
        columns: jax.Array | None = None,
        prefix_segments: jax.Array | None = None,
        increasing_columns: bool = False,
    ) -> jax.Array | tuple[jax.Array, Cache]:
        """Final-normed hidden states ``[B, S, D]`` in ``dtype`` (plus the cache if given).

        ``prefix_segments [B, S]`` (uncached calls only): for each token, the segment of its
        row whose keys it may read besides its own segment's (0: none), as in rows packed
        with ``pack(..., share_prompts=True)``, where a group's completions all continue
        one copy of their prompt. Causality still holds by column.

        ``columns [B, K]`` (uncached calls only) asks for the hidden states of those columns
        of each row alone, ``[B, K, D]``: what ``features(...)`` holds there, up to float
        rounding. The last block then computes only those columns' queries, attention
        output and MLP, which is what a loss on a few ids of each row (the sampled ids of
        RL rows) reads; with the layer scan (``scan_layers``) every block runs whole and
        the columns are taken at the end. Column values are not checked (they are only
        known inside the compiled call): pass values in ``[0, S)``; negative ones count
        from the row's end, as in NumPy, and ones past either end read NaN.

        ``increasing_columns=True`` promises that each row's ``columns`` strictly increase
        (unchecked, like their range). The last block's attention then skips, for each
        block of those queries, the keys that no query of the block can see; the results
        are the same up to float rounding (the order of the softmax sums changes). Columns
        out of order under the promise read wrong values.
        """
        cfg = self.config
        inv_freq = jnp.asarray(cfg.inverse_frequencies())
        tokens, segment_ids, positions = checks.inputs(cfg, tokens, segment_ids, positions)
        if columns is not None:
            columns = checks.columns(columns, tokens.shape, cache)
        if not isinstance(increasing_columns, bool):
            raise TypeError(f"increasing_columns is {increasing_columns!r}; expected a bool")
        if prefix_segments is not None:
            prefix_segments = checks.prefix_segments(prefix_segments, tokens.shape, cache)
        x = jnp.take(self.embed, tokens, axis=0).astype(cfg.dtype)
        if cache is None:
            positions = _default_positions(tokens, positions, None)
            cos, sin = attention.rotary_angles_once(positions, inv_freq)
            mask = attention.causal_segment_mask(segment_ids, prefix_segments)
            context = dict(cos=cos, sin=sin, mask=mask)
            x, _ = self._blocks(x, None, context, columns, increasing_columns)
            return self.final_norm(x)
        cache_index = checks.cache(cfg, cache, cache_index, tokens.shape)
        positions = _default_positions(tokens, positions, cache_index)
        cos, sin = attention.rotary_angles(positions, inv_freq)
        old, new = attention.cache_mask(cache["positions"], positions, segment_ids, cache_index)
        context = dict(cos=cos, sin=sin, mask=new, cache_mask=old)
        x, (keys, values) = self._blocks(x, (cache["key"], cache["value"]), context)
        cache = _write_cache(cache, keys, values, positions, segment_ids, cache_index)
        return self.final_norm(x), cache

    def _blocks(
        self,
        x: jax.Array,
        caches: tuple[jax.Array, jax.Array] | None,
        context: dict,
        columns: jax.Array | None = None,
        increasing: bool = False,
    ) -> tuple[jax.Array, Any]:
        """Runs every block: under the layer scan, or one after another (``scan_layers``).
        Given ``columns``, returns those columns only: unrolled, the last block computes
        them alone (``increasing``: they strictly increase in each row); under the scan,
        every block runs whole and they are taken after."""
        cfg = self.config
        if cfg.uses_layer_scan or self.is_initializing():
            x, entries = self.layers(x, caches, context)
            if columns is not None:
                x = jnp.take_along_axis(x, columns[:, :, None], axis=1)
            return x, entries
        # Same stacked parameters as the scan makes (and init always goes through the scan),
        # each layer applied to its own slice: no stacked per-layer activations to write
        # into and read back from, which is what the scan's backward pass needs.
        stacked = self.variables["params"]["layers"]
        block = Block(cfg, parent=None)  # unbound: applied to each slice explicitly

        def layer(params: Any, x: jax.Array, layer_cache: Any, context: dict):
            return block.apply({"params": params}, x, layer_cache, context)

        if cfg.remat_policy is not None:
            layer = jax.checkpoint(layer, policy=cfg.remat_policy, prevent_cse=False)
        entries = []
        for index in range(cfg.num_layers):
            params = jax.tree.map(lambda leaf, i=index: leaf[i], stacked)
            layer_cache = None if caches is None else (caches[0][index], caches[1][index])
            if columns is not None and index == cfg.num_layers - 1:
                context = {**context, "columns": columns}  # the last block: those columns
                if increasing:  # a static flag, not an array
                    context["increasing"] = True
            x, new = layer(params, x, layer_cache, context)
            entries.append(new)
        if caches is None:
            return x, None
        return x, tuple(jnp.stack(parts) for parts in zip(*entries, strict=True))

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Output projection of final-normed ``hidden [..., D]`` to float32 logits ``[..., V]``."""
        cfg = self.config
        hidden = jnp.asarray(hidden).astype(cfg.dtype)
        if hidden.shape[-1] != cfg.emb_features:
            raise ValueError(
                f"hidden has shape {hidden.shape}; expected last axis emb_features={cfg.emb_features}"
            )
        head = self.embed if cfg.tie_embeddings else self.lm_head
        dtype = matmul_dtype(cfg.dtype, head.dtype)
        flat = hidden.reshape(-1, cfg.emb_features).astype(dtype)
        if cfg.tie_embeddings:
            out = jax.lax.dot_general(
                flat,
                head.astype(dtype),
                (((1,), (1,)), ((), ())),
                preferred_element_type=jnp.float32,
            )
        else:
            out = matmul(flat, head)
        return out.astype(jnp.float32).reshape(*hidden.shape[:-1], cfg.vocab_size)

    def cross_entropy(self, hidden: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Next-token loss of the head without materializing all logits for autodiff.

        Equal to ``optax.softmax_cross_entropy_with_integer_labels(logits(hidden), targets)``
        (float32 rounding aside), with a hand-written backward pass; see
        `dew_pipe.models.cross_entropy`.

        Args:
            hidden: ``[..., D]`` final-normed hidden states (from ``features``).
            targets: ``[...]`` integer ids in ``[0, vocab_size)``.

        Returns:
            ``(nll, correct)``: float32 ``[...]`` negative log-likelihoods and bool ``[...]``,
            True where the target is the argmax of the logits.

        Raises:
            ValueError: for a hidden width other than ``emb_features`` or mismatched shapes.

        Example:
            >>> nll, correct = model.apply(v, hidden, targets, method="cross_entropy")  # doctest: +SKIP
        """
        cfg = self.config
        hidden = jnp.asarray(hidden).astype(cfg.dtype)
        if hidden.shape[-1] != cfg.emb_features:
            raise ValueError(
                f"hidden has shape {hidden.shape}; expected last axis emb_features={cfg.emb_features}"
            )
        if cfg.tie_embeddings:
            return head_cross_entropy(hidden, self.embed, targets, transposed=True)
        return head_cross_entropy(hidden, self.lm_head, targets)

    @nn.nowrap
    def init_cache(self, batch: int, length: int, dtype: Any = None) -> Cache:
        """An empty cache for ``batch`` rows of ``length`` slots (keys/values in ``dtype``).

        Args:
            batch: rows.
            length: slots per row, at most ``max_seq_len``.
            dtype: key/value dtype; None means the model's compute dtype.

        Returns:
            ``{"key", "value": zeros [L, B, T, K, d], "positions": full(-1) [B, T] int32}``.

        Raises:
            ValueError: a non-positive size or ``length > max_seq_len``.

        Example:
            >>> cache = model.init_cache(2, 16)   # doctest: +SKIP
        """
        cfg = self.config
        for name, value in (("batch", batch), ("length", length)):
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value <= 0:
                raise ValueError(f"init_cache {name} is {value!r}; expected a positive int")
        if length > cfg.max_seq_len:
            raise ValueError(
                f"init_cache length is {length}; expected at most max_seq_len={cfg.max_seq_len}"
            )
        dtype = cfg.dtype if dtype is None else np.dtype(dtype)
        shape = (cfg.num_layers, batch, length, cfg.num_kv_heads, cfg.head_dim)
        return {
            "key": jnp.zeros(shape, dtype),
            "value": jnp.zeros(shape, dtype),
            "positions": jnp.full((batch, length), -1, jnp.int32),
        }

    @nn.nowrap
    def reset_cache(self, cache: Cache, rows: jax.Array) -> Cache:
        """Marks every slot of the selected rows empty (for a row that takes a new sequence).

        Args:
            cache: a cache from `init_cache`.
            rows: ``[B]`` bool, True for the rows to clear.

        Returns:
            The cache with those rows' positions set to −1 (keys/values are left in place;
            an empty slot is never attended).
        """
        rows = jnp.asarray(rows, bool)
        positions = jnp.where(rows[:, None], -1, cache["positions"])
        return {**cache, "positions": positions}


def _default_positions(
    tokens: jax.Array, positions: jax.Array | None, cache_index: jax.Array | None
) -> jax.Array:
    if positions is not None:
        return positions
    steps = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
    if cache_index is None:
        return jnp.broadcast_to(steps, tokens.shape)
    return cache_index[:, None] + steps


def _write_cache(
    cache: Cache,
    keys: jax.Array,
    values: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array,
    cache_index: jax.Array,
) -> Cache:
    """Stores all layers' new entries ``[L, B, S, K, d]`` at each row's slots in one scatter."""
    batch, length = positions.shape
    rows = jnp.arange(batch)[:, None]
    slots = cache_index[:, None] + jnp.arange(length)[None, :]
    # Negative indices would wrap around (NumPy semantics); send them past the end instead,
    # where mode="drop" discards them like any other out-of-range slot.
    slots = jnp.where(slots < 0, cache["positions"].shape[1], slots)
    stored = jnp.where(segment_ids > 0, positions, -1).astype(jnp.int32)
    dtype = cache["key"].dtype
    return {
        "key": cache["key"].at[:, rows, slots].set(keys.astype(dtype), mode="drop"),
        "value": cache["value"].at[:, rows, slots].set(values.astype(dtype), mode="drop"),
        "positions": cache["positions"].at[rows, slots].set(stored, mode="drop"),
    }
