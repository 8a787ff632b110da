"""Models: the causal decoder, its builder, and Hugging Face checkpoints in and out.

``build(name, **config)`` makes a model by registered name; ``load_pretrained(directory)``
reads a transformers checkpoint (Llama, Qwen3) into a `Pretrained`, whose ``save`` and
``export`` write the same layout back. The Hugging Face half is imported only when used.
``SimpleDiT`` (``dit.py``) is the small diffusion transformer rectified-flow objectives train.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from dew_pipe.models.config import RopeScaling, TransformerConfig
from dew_pipe.models.transformer import CausalTransformer

__all__ = [
    "CausalTransformer",
    "Pretrained",
    "RopeScaling",
    "SimpleDiT",
    "TransformerConfig",
    "build",
    "load_pretrained",
    "register",
]


def _causal_transformer(**config: Any) -> CausalTransformer:
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    unknown = sorted(set(config) - fields)
    if unknown:
        raise TypeError(
            f"causal_transformer got unknown option(s) {unknown}; expected some of {sorted(fields)}"
        )
    required = [
        f.name for f in dataclasses.fields(TransformerConfig) if f.default is dataclasses.MISSING
    ]
    missing = [name for name in required if name not in config]
    if missing:
        raise TypeError(f"causal_transformer is missing required option(s) {missing}")
    return CausalTransformer(TransformerConfig(**config))


_BUILDERS: dict[str, Callable[..., Any]] = {"causal_transformer": _causal_transformer}


def register(name: str, builder: Callable[..., Any]) -> None:
    """Makes ``build(name, **config)`` call ``builder(**config)``.

    Raises:
        ValueError: ``name`` is already registered.
    """
    if name in _BUILDERS:
        raise ValueError(f"model name {name!r} is already registered")
    _BUILDERS[name] = builder


def build(name: str, **config: Any) -> Any:
    """Builds a model by name.

    Args:
        name: ``"causal_transformer"`` (see `TransformerConfig` for its options), or a name
            added with `register`.
        **config: the model's options.

    Returns:
        An (unbound) Flax linen module with a ``config`` attribute.

    Raises:
        ValueError: an unknown name, or an option with a bad value.
        TypeError: an unknown or missing option.

    Example:
        >>> model = build("causal_transformer", vocab_size=8, emb_features=16, num_layers=1,
        ...               num_heads=2, mlp_features=32, max_seq_len=4)
        >>> model.config.head_dim
        8
    """
    if name not in _BUILDERS:
        raise ValueError(f"model name {name!r} is unknown; expected one of {sorted(_BUILDERS)}")
    return _BUILDERS[name](**config)


def __getattr__(name: str) -> Any:
    if name in ("Pretrained", "load_pretrained"):
        from dew_pipe.models import hf

        return getattr(hf, name)
    if name == "SimpleDiT":  # the diffusion transformer of Flow-GRPO (models/dit.py)
        from dew_pipe.models.dit import SimpleDiT

        return SimpleDiT
    raise AttributeError(f"module 'dew_pipe.models' has no attribute {name!r}")
