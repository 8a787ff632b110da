"""One decode step of the causal decoder for compiled loops: one new id per row.

`decode_step(model, variables)` returns a `DecodeStep` that a ``lax.while_loop`` body
calls once per generated position. It computes what the decoder's own cached call computes
(``model.apply(..., cache=..., cache_index=...)`` with one token per row), but is laid out
for XLA's in-place updates, because on CPU a small model's decode step is bound by memory
traffic, not arithmetic. Against calling the cached model in the loop it saves, per step:

- **Weight copies.** The decoder stacks every layer's weights on a leading axis and scans
  over it; inside a loop each per-layer slice becomes a copy of that layer's weights on
  every step. Here the slices are taken once, when the step is built, and the blocks run
  one by one on them (the decoder's `Block` arithmetic: its norm, dense and SwiGLU
  functions).
- **Cache copies.** Each layer's keys and values live in their own array, so no per-layer
  slice of a stacked cache is copied. The keys/values of the id fed at one step are written
  at the start of the next, *before* the blocks read the cache: every read then depends on
  the write, so XLA updates the cache in place. (Written after the reads, as the cached
  call does, XLA cannot order the write after reads it does not depend on, and copies the
  whole cache every step.) The current id attends to its own key/value directly, as in the
  cached call.
- **Cache reads.** Each layer's keys and values are kept head-major, keys ``[B, K, d, T]``
  and values ``[B, K, T, d]``, so the attention contracts every head against its own
  entries with the leading axes as the batch (`dew_pipe.models.attention.attend_step`).
  In the decoder's ``[B, T, K, d]`` layout the per-head contraction needs a transposed
  copy of the cache first, and the copy-free block form the cached call uses does K times
  the arithmetic; at 128 rows of 88 slots that was most of a small model's decode step.
  `start` makes the head-major copy once per call from ``init_cache``'s layout, `finish`
  turns it back.
- **Kernel launches.** Matmuls that read the same input run as one: q, k and v on joined
  columns, gate and up likewise (joined once, with the slicing). At batch 16 each small
  matmul costs about as much to launch as to compute, and the step has three per layer
  fewer (7% off a 64-id greedy call of the benchmark decoder, bfloat16 weights). The
  results equal the separate matmuls' up to float32 summation order.

Models other than `CausalTransformer` get a step that calls the cached model (same results,
without those savings), so anything with the decoder's call forms can generate.

A caller that keeps a cache between compiled calls (the continuous-batching server) keeps
it as a `LayerCache`, one array per layer, which `start` takes as it is and `flush` gives
back: slicing a stacked cache into per-layer arrays at the start of each call and stacking
them again at its end would copy the whole cache twice per call.

A row is *inactive* when it has finished: its entries go to an out-of-range slot, which the
scatter drops, so its cache stays exactly as it was. Steps are pytrees: a server that runs
one jitted step per call builds the step once (slicing the weights once) and passes it to
its jitted function as an argument; `reset` gives a row a new sequence between steps.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp

from dew_pipe.models import attention
from dew_pipe.models.transformer import CausalTransformer, dense, rms_norm, swiglu

__all__ = [
    "DecodeStep",
    "LayerCache",
    "decode_step",
    "head_major",
    "layer_cache",
    "serving_cache",
]


class LayerCache(NamedTuple):
    """A decoder cache split by layer, one head-major array per layer.

    ``init_cache``'s entries with each layer's keys as ``[B, K, d, T]`` and values as
    ``[B, K, T, d]`` (kv heads first; `head_major`), so a decode step contracts each head
    against its own entries without moving them (`dew_pipe.models.attention.attend_step`).
    """

    keys: tuple[jax.Array, ...]  # per layer [B, K, d, T]
    values: tuple[jax.Array, ...]
    positions: jax.Array  # [B, T] int32, -1 empty


def layer_cache(cache: dict[str, jax.Array]) -> LayerCache:
    """``init_cache``'s stacked ``[L, B, T, K, d]`` cache as a `LayerCache` (a copy).

    Example:
        >>> import jax.numpy as jnp
        >>> cache = {"key": jnp.zeros((2, 1, 4, 3, 8)), "value": jnp.zeros((2, 1, 4, 3, 8)),
        ...          "positions": jnp.full((1, 4), -1)}
        >>> split = layer_cache(cache)
        >>> len(split.keys), split.keys[0].shape, split.values[0].shape
        (2, (1, 3, 8, 4), (1, 3, 4, 8))
    """
    layers = range(cache["key"].shape[0])
    pairs = [head_major(cache["key"][i], cache["value"][i]) for i in layers]
    return LayerCache(
        keys=tuple(k for k, _ in pairs),
        values=tuple(v for _, v in pairs),
        positions=cache["positions"],
    )


def head_major(keys: jax.Array, values: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One layer's ``[B, T, K, d]`` keys and values as `LayerCache` holds them: keys
    ``[B, K, d, T]``, values ``[B, K, T, d]`` (copies)."""
    return jnp.transpose(keys, (0, 2, 3, 1)), jnp.swapaxes(values, 1, 2)


def _slot_major(keys: jax.Array, values: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`head_major` undone: ``[B, T, K, d]`` keys and values."""
    return jnp.transpose(keys, (0, 3, 1, 2)), jnp.swapaxes(values, 1, 2)


class DecodeStep(Protocol):
    """A per-position step: `start` a state from a cache, then call it once per id."""

    def start(self, cache: dict[str, jax.Array] | LayerCache) -> Any:
        """The loop state for a cache from ``model.init_cache`` (filled by a prefill), or
        for a `LayerCache` where the step supports one (`layered`)."""

    def __call__(
        self,
        state: Any,
        tokens: jax.Array,
        positions: jax.Array,
        slots: jax.Array,
        active: jax.Array,
    ) -> tuple[jax.Array, Any]:
        """Feeds ``tokens [B]`` at ``positions [B]`` into cache ``slots [B]``.

        Rows with ``active`` False write nothing. Returns ``(logits [B, V] float32,
        state)``.
        """

    def reset(self, state: Any, rows: jax.Array) -> Any:
        """Empties the rows where ``rows [B]`` is True, for new sequences from slot 0."""

    def finish(self, state: Any) -> dict[str, jax.Array]:
        """The cache a state stands for, every entry written (``init_cache``'s layout)."""

    def flush(self, state: Any) -> Any:
        """The cache a state stands for, every entry written, in the layout `start` takes
        without copying: a `LayerCache` where `layered`, else ``init_cache``'s."""

    @property
    def layered(self) -> bool:
        """Whether `start` takes a `LayerCache` (kept between calls without copies)."""


@jax.tree_util.register_pytree_node_class
class _CachedModelStep:
    """The decoder's own cached call, one id per row (any model with its call forms)."""

    def __init__(self, model: Any, variables: Any) -> None:
        self.model, self.variables = model, variables

    def tree_flatten(self) -> tuple[tuple[Any], Any]:
        return (self.variables,), self.model

    @classmethod
    def tree_unflatten(cls, model: Any, children: tuple[Any]) -> _CachedModelStep:
        return cls(model, *children)

    def start(self, cache: dict[str, jax.Array]) -> dict[str, jax.Array]:
        return cache

    def __call__(self, state, tokens, positions, slots, active):
        length = state["positions"].shape[1]
        hidden, cache = self.model.apply(
            self.variables,
            tokens[:, None],
            active[:, None].astype(jnp.int32),
            positions[:, None],
            cache=state,
            cache_index=jnp.where(active, slots, length),
            method="features",
        )
        return self.model.apply(self.variables, hidden[:, 0], method="logits"), cache

    def reset(self, state: dict[str, jax.Array], rows: jax.Array) -> dict[str, jax.Array]:
        return self.model.reset_cache(state, rows)

    def finish(self, state: dict[str, jax.Array]) -> dict[str, jax.Array]:
        return state

    def flush(self, state: dict[str, jax.Array]) -> dict[str, jax.Array]:
        return state

    layered = False


class _LayerState(NamedTuple):
    keys: tuple[jax.Array, ...]  # per layer [B, K, d, T]
    values: tuple[jax.Array, ...]  # per layer [B, K, T, d]
    positions: jax.Array  # [B, T] int32, -1 empty
    pending_keys: tuple[jax.Array, ...]  # per layer [B, K, d]: the last fed ids' entries
    pending_values: tuple[jax.Array, ...]
    pending_position: jax.Array  # [B] the position stored with them
    pending_slot: jax.Array  # [B] their slot; out of range when nothing is pending


@jax.tree_util.register_pytree_node_class
class _LayerSplitStep:
    """`CausalTransformer` run block by block on pre-sliced weights and per-layer caches."""

    def __init__(self, model: CausalTransformer, variables: Any, layers: Any = None) -> None:
        cfg = model.config
        self.model, self.variables, self.config = model, variables, cfg
        params = variables["params"]
        if layers is None:  # sliced and joined once, not inside the loop
            stacked = params["layers"]
            layers = [
                _joined(jax.tree.map(lambda w, i=i: w[i], stacked)) for i in range(cfg.num_layers)
            ]
        self.layers = layers

    def tree_flatten(self) -> tuple[tuple[Any, Any], Any]:
        return (self.variables, self.layers), self.model

    @classmethod
    def tree_unflatten(cls, model: Any, children: tuple[Any, Any]) -> _LayerSplitStep:
        return cls(model, *children)

    layered = True

    def start(self, cache: dict[str, jax.Array] | LayerCache) -> _LayerState:
        if not isinstance(cache, LayerCache):
            cache = layer_cache(cache)
        batch, slots = cache.positions.shape
        return _LayerState(
            keys=cache.keys,
            values=cache.values,
            positions=cache.positions,
            pending_keys=tuple(jnp.zeros(k.shape[:3], k.dtype) for k in cache.keys),
            pending_values=tuple(
                jnp.zeros((batch, v.shape[1], v.shape[3]), v.dtype) for v in cache.values
            ),
            pending_position=jnp.full((batch,), -1, jnp.int32),
            pending_slot=jnp.full((batch,), slots, jnp.int32),
        )

    @staticmethod
    def _flush(state: _LayerState) -> tuple[tuple, tuple, jax.Array]:
        rows = jnp.arange(state.positions.shape[0])
        at = state.pending_slot  # out of range (dropped) when nothing is pending

        # Each pending entry [B, K, d] lands in its row's slot: keys [B, K, d, T] along the
        # last axis, values [B, K, T, d] along the third.
        keys = tuple(
            stored.at[rows, :, :, at].set(pending, mode="drop")
            for stored, pending in zip(state.keys, state.pending_keys, strict=True)
        )
        values = tuple(
            stored.at[rows, :, at].set(pending, mode="drop")
            for stored, pending in zip(state.values, state.pending_values, strict=True)
        )
        positions = state.positions.at[rows, at].set(state.pending_position, mode="drop")
        return keys, values, positions

    def __call__(self, state, tokens, positions, slots, active):
        cfg = self.config
        params = self.variables["params"]
        length = state.positions.shape[1]
        keys, values, cache_positions = self._flush(state)
        slots = jnp.where(active, slots, length)
        segment = active[:, None].astype(jnp.int32)
        inv_freq = jnp.asarray(cfg.inverse_frequencies())
        cos, sin = attention.rotary_angles(positions[:, None], inv_freq)
        old, new = attention.cache_mask(cache_positions, positions[:, None], segment, slots)
        context = dict(cos=cos, sin=sin, mask=new, cache_mask=old)
        x = jnp.take(params["embed"], tokens[:, None], axis=0).astype(cfg.dtype)
        new_keys, new_values = [], []
        for layer, k, v in zip(self.layers, keys, values, strict=True):
            x, (k_new, v_new) = _block(cfg, layer, x, (k, v), context)
            new_keys.append(k_new[:, 0].astype(k.dtype))
            new_values.append(v_new[:, 0].astype(v.dtype))
        hidden = rms_norm(x, params["final_norm"]["scale"], cfg.norm_eps, cfg.dtype)[:, 0]
        logits = self.model.apply(self.variables, hidden, method="logits")
        state = _LayerState(
            keys=keys,
            values=values,
            positions=cache_positions,
            pending_keys=tuple(new_keys),
            pending_values=tuple(new_values),
            pending_position=jnp.where(active, positions, -1).astype(jnp.int32),
            pending_slot=slots,
        )
        return logits, state

    def reset(self, state: _LayerState, rows: jax.Array) -> _LayerState:
        rows = jnp.asarray(rows, bool)
        keys, values, positions = self._flush(state)  # nothing pending may land later
        return state._replace(
            keys=keys,
            values=values,
            positions=jnp.where(rows[:, None], -1, positions),
            pending_slot=jnp.full_like(state.pending_slot, positions.shape[1]),
        )

    def finish(self, state: _LayerState) -> dict[str, jax.Array]:
        keys, values, positions = self._flush(state)
        pairs = [_slot_major(k, v) for k, v in zip(keys, values, strict=True)]
        return {
            "key": jnp.stack([k for k, _ in pairs]),
            "value": jnp.stack([v for _, v in pairs]),
            "positions": positions,
        }

    def flush(self, state: _LayerState) -> LayerCache:
        return LayerCache(*self._flush(state))


def _joined(layer: dict[str, Any]) -> dict[str, Any]:
    """One layer's parameters with the matmuls that read the same input joined: q, k and v
    as one ``[D, (H + 2K) * d]`` kernel, gate and up as one ``[D, 2F]``."""
    attn, mlp = layer["attn"], layer["mlp"]
    joined = {
        "attn_norm": layer["attn_norm"]["scale"],
        "qkv": jnp.concatenate([attn["q"], attn["k"], attn["v"]], axis=1),
        "o": attn["o"],
        "mlp_norm": layer["mlp_norm"]["scale"],
        "gate_up": jnp.concatenate([mlp["gate"], mlp["up"]], axis=1),
        "down": mlp["down"],
    }
    for name in ("q_norm", "k_norm"):
        if name in attn:
            joined[name] = attn[name]["scale"]
    return joined


def _block(
    cfg: Any, layer: dict[str, Any], x: jax.Array, cache: tuple[jax.Array, jax.Array], context: dict
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """The decoder's `Block` (cached form) on `_joined` parameters: three matmuls fewer.

    A decode step at small batch is bound by the number of kernels it launches as much as by
    their arithmetic. A column-joined matmul computes the same sums as the separate ones, in
    an order of its own (float32 rounding apart).
    """
    H, K, d, F = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_features
    batch, length = x.shape[:2]
    h = rms_norm(x, layer["attn_norm"], cfg.norm_eps, cfg.dtype)
    qkv = dense(h, layer["qkv"])
    q = qkv[..., : H * d].reshape(batch, length, H, d)
    k = qkv[..., H * d : (H + K) * d].reshape(batch, length, K, d)
    v = qkv[..., (H + K) * d :].reshape(batch, length, K, d)
    if cfg.qk_norm:
        q = rms_norm(q, layer["q_norm"], cfg.norm_eps, cfg.dtype)
        k = rms_norm(k, layer["k_norm"], cfg.norm_eps, cfg.dtype)
    cos, sin = context["cos"], context["sin"]
    q = attention.apply_rotary(q, cos, sin) * jnp.asarray(d**-0.5, q.dtype)
    k = attention.apply_rotary(k, cos, sin)
    cached_k, cached_v = (c.astype(q.dtype) for c in cache)  # [B, K, d, T], [B, K, T, d]
    out = attention.attend_step(
        q, (cached_k, cached_v, context["cache_mask"]), (k, v, context["mask"])
    ).reshape(batch, length, H * d)
    x = x + dense(out, layer["o"])
    gate_up = dense(rms_norm(x, layer["mlp_norm"], cfg.norm_eps, cfg.dtype), layer["gate_up"])
    x = x + dense(swiglu(gate_up[..., :F], gate_up[..., F:]), layer["down"])
    return x, (k, v)


def serving_cache(model: Any, cache: dict[str, jax.Array]) -> dict[str, jax.Array] | LayerCache:
    """``cache`` in the layout ``decode_step(model, ...)`` keeps between calls: a
    `LayerCache` for a `CausalTransformer` (the layer-split step), else as it is."""
    return layer_cache(cache) if isinstance(model, CausalTransformer) else cache


def decode_step(model: Any, variables: Any, *, split_layers: bool | None = None) -> DecodeStep:
    """The per-id decode step for ``model``.

    Build it inside the jitted function that runs the loop (outside the loop body), or
    once outside ``jit`` and pass it in as an argument (it is a pytree).

    Args:
        model: a `CausalTransformer`, or any module with its call forms (``features`` and
            ``logits`` methods, ``init_cache``, ``reset_cache`` and the cached call).
        variables: its ``{"params": ...}``.
        split_layers: run a `CausalTransformer` block by block (the fast path); None
            chooses it whenever the model is one, False calls the cached model instead.

    Returns:
        A `DecodeStep`.

    Raises:
        TypeError: ``split_layers=True`` for a model that is not a `CausalTransformer`.

    Example:
        >>> step = decode_step(model, variables)   # doctest: +SKIP
        >>> state = step.start(cache)   # doctest: +SKIP
        >>> logits, state = step(state, ids, positions, positions, active)   # doctest: +SKIP
    """
    splittable = isinstance(model, CausalTransformer)
    if split_layers and not splittable:
        raise TypeError(f"split_layers=True needs a CausalTransformer; got {type(model).__name__}")
    if splittable and split_layers is not False:
        return _LayerSplitStep(model, variables)
    return _CachedModelStep(model, variables)
