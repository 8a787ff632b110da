"""Trace-time checks of the decoder's inputs: dtypes and shapes, named in one-line errors.

They run while a call is traced (shapes and dtypes are static then), so a bad batch fails
before anything compiles. Values (token ids in range, positions) are not checked here:
they are only known inside the compiled computation.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from dew_pipe.models.config import TransformerConfig

__all__ = ["cache", "columns", "inputs", "prefix_segments"]


def _int_array(name: str, value: Any) -> jax.Array:
    array = jnp.asarray(value)
    if not jnp.issubdtype(array.dtype, jnp.integer):
        raise TypeError(f"{name} has dtype {array.dtype}; expected an integer dtype (int32)")
    return array.astype(jnp.int32)


def inputs(
    config: TransformerConfig,
    tokens: Any,
    segment_ids: Any | None,
    positions: Any | None,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Validates and casts ``tokens``, ``segment_ids`` and ``positions`` to int32 ``[B, S]``.

    Returns:
        ``(tokens, segment_ids, positions)``; ``segment_ids`` defaults to ones, ``positions``
        stays None when not given.

    Raises:
        TypeError: a non-integer dtype.
        ValueError: a rank other than 2, mismatched shapes, or a sequence longer than
            ``max_seq_len``.
    """
    tokens = _int_array("tokens", tokens)
    if tokens.ndim != 2:
        raise ValueError(f"tokens has shape {tokens.shape}; expected [batch, seq]")
    if tokens.shape[1] > config.max_seq_len:
        raise ValueError(
            f"tokens has sequence length {tokens.shape[1]}; expected at most "
            f"max_seq_len={config.max_seq_len}"
        )
    if segment_ids is None:
        segment_ids = jnp.ones(tokens.shape, jnp.int32)
    else:
        segment_ids = _int_array("segment_ids", segment_ids)
        if segment_ids.shape != tokens.shape:
            raise ValueError(
                f"segment_ids has shape {segment_ids.shape}; expected tokens' shape {tokens.shape}"
            )
    if positions is not None:
        positions = _int_array("positions", positions)
        if positions.shape != tokens.shape:
            raise ValueError(
                f"positions has shape {positions.shape}; expected tokens' shape {tokens.shape}"
            )
    return tokens, segment_ids, positions


def cache(
    config: TransformerConfig,
    value: Any,
    cache_index: Any | None,
    tokens_shape: tuple[int, int],
) -> jax.Array:
    """Validates a cache against the config and the tokens; returns ``cache_index`` as ``[B]``.

    Raises:
        TypeError / ValueError: a cache that is not what `init_cache` makes for this model,
            a missing or mis-shaped ``cache_index``, or more new tokens than cache slots.
    """
    if not isinstance(value, Mapping) or set(value) != {"key", "value", "positions"}:
        keys = sorted(value) if isinstance(value, Mapping) else type(value).__name__
        raise ValueError(
            f"cache is {keys}; expected the mapping init_cache returns "
            "with 'key', 'value' and 'positions'"
        )
    batch, length = tokens_shape
    slots = value["positions"].shape[-1] if value["positions"].ndim == 2 else -1
    expected = (config.num_layers, batch, slots, config.num_kv_heads, config.head_dim)
    for name in ("key", "value"):
        if value[name].shape != expected:
            raise ValueError(
                f"cache[{name!r}] has shape {value[name].shape}; expected {expected} "
                "(layers, batch, slots, kv heads, head_dim)"
            )
    if value["positions"].shape != (batch, slots):
        raise ValueError(
            f"cache['positions'] has shape {value['positions'].shape}; expected [batch={batch}, slots]"
        )
    if length > slots:
        raise ValueError(f"tokens has sequence length {length}; the cache holds only {slots} slots")
    if cache_index is None:
        raise ValueError("cache_index is None; a cached call needs each row's write offset [batch]")
    index = _int_array("cache_index", cache_index)
    if index.ndim == 0:
        index = jnp.broadcast_to(index, (batch,))
    if index.shape != (batch,):
        raise ValueError(
            f"cache_index has shape {index.shape}; expected [batch={batch}] or a scalar"
        )
    return index


def columns(value: Any, shape: tuple[int, ...], cache: Any) -> jax.Array:
    """``features(..., columns=value)``: integer ``[B, K]`` with ``1 <= K <= S``, uncached."""
    if cache is not None:
        raise ValueError(
            "columns applies to uncached calls (training and scoring); a cached call got it"
        )
    value = _int_array("columns", value)
    rows, length = shape
    if value.ndim != 2 or value.shape[0] != rows or not 1 <= value.shape[1] <= length:
        raise ValueError(
            f"columns has shape {tuple(value.shape)}; expected [{rows}, K] with K from 1 to "
            f"{length} (the tokens' [batch, seq] is {tuple(shape)})"
        )
    return value


def prefix_segments(value: Any, shape: tuple[int, ...], cache: Any) -> jax.Array:
    """``prefix_segments``: integer ``[B, S]`` like the tokens, in uncached calls only."""
    if cache is not None:
        raise ValueError(
            "prefix_segments applies to uncached calls (training and scoring); a cached call got it"
        )
    value = _int_array("prefix_segments", value)
    if tuple(value.shape) != tuple(shape):
        raise ValueError(
            f"prefix_segments has shape {tuple(value.shape)}; expected tokens' shape {tuple(shape)}"
        )
    return value
