"""Hugging Face configs of Llama and Qwen3 checkpoints, to and from `TransformerConfig`.

config.json is read through transformers' own config classes (no torch needed), so legacy
spellings (``torch_dtype``, top-level ``rope_theta``/``rope_scaling``) are normalised the way
transformers normalises them, and a saved config is one transformers writes itself.
Settings the decoder does not implement (biases, sliding windows, other activations or
rotary variants) are refused by name rather than silently ignored.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from dew_pipe.models.config import RopeScaling, TransformerConfig

__all__ = ["ARCHITECTURES", "from_transformer_config", "read", "to_transformer_config"]

# architecture -> (model_type, has q/k norm)
ARCHITECTURES = {"LlamaForCausalLM": ("llama", False), "Qwen3ForCausalLM": ("qwen3", True)}


def _config_class(architecture: str) -> Any:
    import transformers

    return {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config}[
        ARCHITECTURES[architecture][0]
    ]


def architecture_of(config: Any) -> str:
    """The one supported architecture a transformers config names.

    Raises:
        ValueError: none or several architectures, or one this module does not know.
    """
    names = list(getattr(config, "architectures", None) or [])
    if len(names) != 1 or names[0] not in ARCHITECTURES:
        raise ValueError(
            f"config architectures is {names}; expected exactly one of {sorted(ARCHITECTURES)}"
        )
    return names[0]


def read(directory: Path) -> Any:
    """Reads ``directory/config.json`` into a transformers config (LlamaConfig / Qwen3Config).

    Raises:
        FileNotFoundError: no config.json.
        ValueError: unreadable JSON or an unsupported architecture.
    """
    path = directory / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint directory {directory} has no config.json")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from error
    names = raw.get("architectures") or []
    if len(names) != 1 or names[0] not in ARCHITECTURES:
        raise ValueError(
            f"{path} names architectures {names}; expected exactly one of {sorted(ARCHITECTURES)}"
        )
    model_type = ARCHITECTURES[names[0]][0]
    if raw.get("model_type", model_type) != model_type:
        raise ValueError(
            f"{path} has model_type {raw.get('model_type')!r}; {names[0]} needs {model_type!r}"
        )
    return _config_class(names[0]).from_pretrained(str(directory), local_files_only=True)


def _rope(config: Any) -> tuple[float, RopeScaling | None]:
    params = dict(getattr(config, "rope_parameters", None) or {})
    kind = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(
            f"rope_parameters.partial_rotary_factor is {params['partial_rotary_factor']}; "
            "only full rotary embeddings (1.0) are supported"
        )
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, RopeScaling("linear", float(params["factor"]))
    if kind == "llama3":
        return theta, RopeScaling(
            "llama3",
            float(params["factor"]),
            float(params["low_freq_factor"]),
            float(params["high_freq_factor"]),
            int(params["original_max_position_embeddings"]),
        )
    raise ValueError(
        f"rope_parameters.rope_type is {kind!r}; expected 'default', 'linear' or 'llama3'"
    )


def _refuse_unsupported(config: Any) -> None:
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config hidden_act is {act!r}; only 'silu' (SwiGLU) is supported")
    for name in ("attention_bias", "mlp_bias"):
        if getattr(config, name, False):
            raise ValueError(f"config {name} is True; the decoder has no projection biases")
    layer_types = getattr(config, "layer_types", None) or []
    others = sorted({t for t in layer_types if t != "full_attention"})
    if getattr(config, "use_sliding_window", False) or others:
        raise ValueError(
            f"config layer_types include {others or ['sliding_attention']}; "
            "only full attention is supported"
        )


def to_transformer_config(config: Any, **options: Any) -> TransformerConfig:
    """The `TransformerConfig` of a transformers Llama/Qwen3 config.

    Args:
        config: a transformers config naming one supported architecture.
        **options: `TransformerConfig` fields to set or override (``dtype``, ``param_dtype``,
            ``max_seq_len``, ``remat``, ...).

    Raises:
        ValueError: an unsupported architecture or setting, named.
    """
    architecture = architecture_of(config)
    _refuse_unsupported(config)
    theta, scaling = _rope(config)
    heads = config.num_attention_heads
    fields = dict(
        vocab_size=config.vocab_size,
        emb_features=config.hidden_size,
        num_layers=config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        mlp_features=config.intermediate_size,
        max_seq_len=config.max_position_embeddings,
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=float(config.rms_norm_eps),
        qk_norm=ARCHITECTURES[architecture][1],
        tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        init_std=float(getattr(config, "initializer_range", 0.02)),
    )
    return TransformerConfig(**{**fields, **options})


def _rope_parameters(cfg: TransformerConfig) -> dict[str, Any]:
    scaling = cfg.rope_scaling
    if scaling is None:
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if scaling.kind == "linear":
        return {"rope_type": "linear", "factor": scaling.factor, "rope_theta": cfg.rope_theta}
    return {
        "rope_type": "llama3",
        "factor": scaling.factor,
        "low_freq_factor": scaling.low_freq_factor,
        "high_freq_factor": scaling.high_freq_factor,
        "original_max_position_embeddings": scaling.original_max_position_embeddings,
        "rope_theta": cfg.rope_theta,
    }


def from_transformer_config(
    cfg: TransformerConfig, architecture: str | None = None, **extra: Any
) -> Any:
    """A transformers config describing the decoder ``cfg``.

    Args:
        cfg: the decoder's config.
        architecture: ``"LlamaForCausalLM"`` or ``"Qwen3ForCausalLM"``; None picks Qwen3 when
            ``cfg.qk_norm`` is set and Llama otherwise.
        **extra: further transformers config fields (``bos_token_id``, ``eos_token_id``, ...).

    Raises:
        ValueError: an unknown architecture, or one that disagrees with ``cfg.qk_norm``.
    """
    if architecture is None:
        architecture = "Qwen3ForCausalLM" if cfg.qk_norm else "LlamaForCausalLM"
    if architecture not in ARCHITECTURES:
        raise ValueError(
            f"architecture is {architecture!r}; expected one of {sorted(ARCHITECTURES)}"
        )
    if ARCHITECTURES[architecture][1] != cfg.qk_norm:
        raise ValueError(
            f"architecture {architecture} {'needs' if not cfg.qk_norm else 'has no'} q/k norm, "
            f"but the model has qk_norm={cfg.qk_norm}"
        )
    fields = dict(
        architectures=[architecture],
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.emb_features,
        intermediate_size=cfg.mlp_features,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        hidden_act="silu",
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        rope_parameters=_rope_parameters(cfg),
        initializer_range=cfg.init_std,
        dtype=str(np.dtype(cfg.param_dtype)),
    )
    return _config_class(architecture)(**{**fields, **extra})
