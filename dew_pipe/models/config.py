"""Configuration of the causal decoder: one frozen dataclass, validated when it is built.

`TransformerConfig` describes a Llama/Qwen3-family decoder. Every value is checked in
`__post_init__`, so a bad setting fails before anything is traced or compiled, with a
one-line message naming the field. Optional sizes (`num_kv_heads`, `head_dim`) are resolved
to integers there, so code reading a config never sees ``None`` for them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from dew_pipe._validate import check_int

__all__ = ["RopeScaling", "TransformerConfig"]

_REMAT_TRUE = "nothing_saveable"
_UNROLL_LAYERS = 8  # scan_layers=None unrolls up to this many blocks


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Rescaling of the rotary frequencies, as Hugging Face's ``rope_parameters`` describe it.

    Args:
        kind: ``"linear"`` (every frequency divided by ``factor``) or ``"llama3"`` (Llama 3.1:
            low frequencies divided by ``factor``, high ones kept, a smooth blend between).
        factor: the context extension factor (> 0).
        low_freq_factor: llama3 only; wavelengths above
            ``original_max_position_embeddings / low_freq_factor`` are fully rescaled.
        high_freq_factor: llama3 only; wavelengths below
            ``original_max_position_embeddings / high_freq_factor`` are left alone.
        original_max_position_embeddings: llama3 only; the pre-training context length.

    Raises:
        ValueError: an unknown kind or a non-positive factor.

    Example:
        >>> RopeScaling("llama3", factor=8.0).kind
        'llama3'
    """

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.kind not in ("linear", "llama3"):
            raise ValueError(f"rope_scaling.kind is {self.kind!r}; expected 'linear' or 'llama3'")
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"rope_scaling.{name} is {value!r}; expected a positive number")
        if self.kind == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"rope_scaling.high_freq_factor ({self.high_freq_factor}) must exceed "
                f"low_freq_factor ({self.low_freq_factor})"
            )
        if self.original_max_position_embeddings <= 0:
            raise ValueError(
                "rope_scaling.original_max_position_embeddings is "
                f"{self.original_max_position_embeddings}; expected a positive int"
            )

    @classmethod
    def from_mapping(cls, value: Mapping[str, Any]) -> RopeScaling:
        """Builds one from a dict such as ``{"kind": "linear", "factor": 2.0}``."""
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - fields)
        if unknown:
            raise ValueError(f"rope_scaling has unknown keys {unknown}; expected {sorted(fields)}")
        return cls(**value)

    def inverse_frequencies(self, inv_freq: np.ndarray) -> np.ndarray:
        """Applies the rescaling to float32 inverse frequencies (the way transformers does)."""
        if self.kind == "linear":
            return (inv_freq / np.float32(self.factor)).astype(np.float32)
        context = float(self.original_max_position_embeddings)
        low_wavelen = context / self.low_freq_factor
        high_wavelen = context / self.high_freq_factor
        wavelen = (2 * math.pi / inv_freq).astype(np.float32)
        scaled = np.where(wavelen > low_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (context / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        blended = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, blended, scaled).astype(np.float32)


def _positive_int(name: str, value: Any) -> None:
    # One wording (dew_pipe._validate); a config has always raised ValueError for a size
    # that is not an int (2.5 layers), so the TypeError is re-raised as one.
    try:
        check_int(name, value, minimum=1)
    except TypeError as error:
        raise ValueError(str(error)) from None


def _float_dtype(name: str, value: Any) -> np.dtype:
    try:
        dtype = np.dtype(value)
    except TypeError as error:
        raise TypeError(f"{name} is {value!r}; expected a floating dtype") from error
    if not jax.numpy.issubdtype(dtype, jax.numpy.floating):
        raise ValueError(f"{name} is {dtype}; expected a floating dtype (float32, bfloat16)")
    return dtype


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Sizes and options of a causal decoder (Llama/Qwen3 family).

    Args:
        vocab_size: number of token ids.
        emb_features: width of the residual stream (Hugging Face ``hidden_size``).
        num_layers: decoder blocks.
        num_heads: query heads.
        mlp_features: hidden width of the SwiGLU MLP (``intermediate_size``).
        max_seq_len: longest sequence (and longest cache) the model accepts; longer inputs
            are refused rather than silently extrapolated.
        num_kv_heads: key/value heads for grouped-query attention; ``None`` means
            ``num_heads`` (plain multi-head attention). Must divide ``num_heads``.
        head_dim: features per head; ``None`` means ``emb_features // num_heads``. Qwen3
            checkpoints set it independently of ``emb_features``. Must be even (rotary).
        rope_theta: rotary base wavelength.
        rope_scaling: optional `RopeScaling` (or a dict for one), e.g. Llama 3.1's.
        norm_eps: epsilon inside every RMSNorm.
        qk_norm: RMSNorm on each query and key head before the rotation (Qwen3).
        tie_embeddings: the output projection reuses the token embedding.
        dtype: compute dtype of activations and matmuls; logits are always float32.
        param_dtype: dtype parameters are created in.
        init_std: standard deviation of the normal initialiser of every matrix (as
            transformers' ``initializer_range``); norm scales start at one.
        remat: recompute each block in the backward pass to save memory: ``False``, ``True``
            (save nothing), or the name of a ``jax.checkpoint_policies`` policy.
        scan_unroll: how many layers one iteration of the layer scan runs; parameters stay
            stacked either way, so this is a pure speed knob.
        scan_layers: run the blocks under one ``lax.scan`` (True: one block is compiled
            whatever the depth) or one after another (False: the backward pass reads each
            layer's activations directly instead of through the scan's stacked buffers,
            about 10% faster per step on the CPU backend, for a compile time that grows with
            depth). ``None`` (default) scans above 8 layers and unrolls up to 8. Parameters
            are stacked on a leading layer axis and initialized identically either way.

    Raises:
        ValueError / TypeError: a field with a bad value, named in the message.

    Example:
        >>> cfg = TransformerConfig(vocab_size=8, emb_features=16, num_layers=1, num_heads=2,
        ...                         mlp_features=32, max_seq_len=4)
        >>> cfg.num_kv_heads, cfg.head_dim
        (2, 8)
    """

    vocab_size: int
    emb_features: int
    num_layers: int
    num_heads: int
    mlp_features: int
    max_seq_len: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-6
    qk_norm: bool = False
    tie_embeddings: bool = False
    dtype: Any = np.float32
    param_dtype: Any = np.float32
    init_std: float = 0.02
    remat: bool | str = False
    scan_unroll: int = 1
    scan_layers: bool | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "emb_features", "num_layers", "num_heads"):
            _positive_int(name, getattr(self, name))
        for name in ("mlp_features", "max_seq_len", "scan_unroll"):
            _positive_int(name, getattr(self, name))
        self._resolve_heads()
        for name in ("rope_theta", "norm_eps", "init_std"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} is {value!r}; expected a positive finite number")
        scaling = self.rope_scaling
        if isinstance(scaling, Mapping):
            object.__setattr__(self, "rope_scaling", RopeScaling.from_mapping(scaling))
        elif scaling is not None and not isinstance(scaling, RopeScaling):
            raise TypeError(f"rope_scaling is {scaling!r}; expected None, a dict or RopeScaling")
        for name in ("qk_norm", "tie_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} is {getattr(self, name)!r}; expected a bool")
        if self.scan_layers is not None and not isinstance(self.scan_layers, bool):
            raise TypeError(f"scan_layers is {self.scan_layers!r}; expected None or a bool")
        object.__setattr__(self, "dtype", _float_dtype("dtype", self.dtype))
        object.__setattr__(self, "param_dtype", _float_dtype("param_dtype", self.param_dtype))
        remat_ok = isinstance(self.remat, bool) or (
            isinstance(self.remat, str) and hasattr(jax.checkpoint_policies, self.remat)
        )
        if not remat_ok:
            raise ValueError(
                f"remat is {self.remat!r}; expected a bool or the name of a "
                "jax.checkpoint_policies policy such as 'dots_saveable'"
            )

    def _resolve_heads(self) -> None:
        kv = self.num_heads if self.num_kv_heads is None else self.num_kv_heads
        _positive_int("num_kv_heads", kv)
        if self.num_heads % kv:
            raise ValueError(
                f"num_kv_heads ({kv}) must divide num_heads ({self.num_heads}) "
                "for grouped-query attention"
            )
        head_dim = self.head_dim
        if head_dim is None:
            if self.emb_features % self.num_heads:
                raise ValueError(
                    f"emb_features ({self.emb_features}) is not divisible by num_heads "
                    f"({self.num_heads}); pass head_dim explicitly"
                )
            head_dim = self.emb_features // self.num_heads
        _positive_int("head_dim", head_dim)
        if head_dim % 2:
            raise ValueError(f"head_dim is {head_dim}; rotary embeddings need an even head_dim")
        object.__setattr__(self, "num_kv_heads", int(kv))
        object.__setattr__(self, "head_dim", int(head_dim))

    @property
    def uses_layer_scan(self) -> bool:
        """Whether the blocks run under ``lax.scan`` (``scan_layers``, resolved)."""
        if self.scan_layers is None:
            return self.num_layers > _UNROLL_LAYERS
        return self.scan_layers

    @property
    def remat_policy(self) -> Any:
        """The ``jax.checkpoint`` policy for ``remat``, or None when remat is off."""
        if self.remat is False:
            return None
        return getattr(jax.checkpoint_policies, _REMAT_TRUE if self.remat is True else self.remat)

    def inverse_frequencies(self) -> np.ndarray:
        """Rotary inverse frequencies, float32 ``[head_dim // 2]``, computed as transformers does."""
        exponents = np.arange(0, self.head_dim, 2, dtype=np.float32) / np.float32(self.head_dim)
        inv_freq = (1.0 / np.power(np.float32(self.rope_theta), exponents)).astype(np.float32)
        if self.rope_scaling is not None:
            inv_freq = self.rope_scaling.inverse_frequencies(inv_freq)
        return inv_freq

    def replace(self, **changes: Any) -> TransformerConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)
