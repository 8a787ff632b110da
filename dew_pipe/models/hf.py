"""Hugging Face checkpoints in and out: Llama and Qwen3 in the transformers safetensors layout.

`load_pretrained(directory)` reads ``config.json`` plus ``model.safetensors`` (or a sharded
``model.safetensors.index.json``) into a `Pretrained`: the decoder, its variables and the
transformers config. `Pretrained.save` writes the same layout back (sharded above a size
threshold), which transformers and vLLM load; `Pretrained.export` returns the tensors
``save`` writes, by transformers name.

Name mapping (``i`` a layer; torch ``Linear`` weights are ``[out, in]``, ours ``[in, out]``,
so every matrix is transposed on the way in and out)::

    model.embed_tokens.weight                      embed
    model.layers.i.input_layernorm.weight          layers/attn_norm/scale[i]
    model.layers.i.self_attn.{q,k,v,o}_proj.weight layers/attn/{q,k,v,o}[i]ᵀ
    model.layers.i.self_attn.{q,k}_norm.weight     layers/attn/{q,k}_norm/scale[i]  (Qwen3)
    model.layers.i.post_attention_layernorm.weight layers/mlp_norm/scale[i]
    model.layers.i.mlp.{gate,up,down}_proj.weight  layers/mlp/{gate,up,down}[i]ᵀ
    model.norm.weight                              final_norm/scale
    lm_head.weight                                 lm_head ᵀ   (absent when tied)

Rotary weights need no permutation: the decoder rotates halves the way transformers does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from dew_pipe._files import write_atomic
from dew_pipe._validate import check_int
from dew_pipe.models import hf_config
from dew_pipe.models.config import TransformerConfig
from dew_pipe.models.transformer import CausalTransformer

__all__ = ["Pretrained", "load_pretrained"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 5 * 10**9  # the Hub's customary shard size

# Files besides the weights that make a checkpoint directory servable (tokenizer, generation
# defaults); `save` copies them from the directory a Pretrained was loaded from.
_COMPANIONS = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
# Buffers old transformers versions wrote into checkpoints; recomputed, never loaded.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)

# (path under params["layers"], transformers name after "model.layers.{i}.", transpose)
_LAYER_TENSORS = (
    (("attn_norm", "scale"), "input_layernorm.weight", False),
    (("attn", "q"), "self_attn.q_proj.weight", True),
    (("attn", "k"), "self_attn.k_proj.weight", True),
    (("attn", "v"), "self_attn.v_proj.weight", True),
    (("attn", "o"), "self_attn.o_proj.weight", True),
    (("attn", "q_norm", "scale"), "self_attn.q_norm.weight", False),
    (("attn", "k_norm", "scale"), "self_attn.k_norm.weight", False),
    (("mlp_norm", "scale"), "post_attention_layernorm.weight", False),
    (("mlp", "gate"), "mlp.gate_proj.weight", True),
    (("mlp", "up"), "mlp.up_proj.weight", True),
    (("mlp", "down"), "mlp.down_proj.weight", True),
)
_TOP_TENSORS = (
    (("embed",), "model.embed_tokens.weight", False),
    (("final_norm", "scale"), "model.norm.weight", False),
    (("lm_head",), "lm_head.weight", True),
)


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One transformers tensor: where it lives in params, its layer (None: not stacked)."""

    path: tuple[str, ...]
    layer: int | None
    transpose: bool
    shape: tuple[int, ...]  # transformers shape


def _entries(model: CausalTransformer) -> dict[str, _Entry]:
    """Every transformers tensor of ``model``, with its expected (transformers) shape."""
    return _entries_of(model.config)


@functools.lru_cache(maxsize=16)
def _entries_of(config: TransformerConfig) -> dict[str, _Entry]:
    model = CausalTransformer(config)
    shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 1), jnp.int32))
    params = shapes["params"]
    out: dict[str, _Entry] = {}
    for path, name, transpose in _TOP_TENSORS:
        leaf = _get(params, path)
        if leaf is not None:
            out[name] = _Entry(path, None, transpose, _hf_shape(leaf.shape, transpose))
    for path, suffix, transpose in _LAYER_TENSORS:
        leaf = _get(params["layers"], path)
        if leaf is None:
            continue
        for i in range(config.num_layers):
            shape = _hf_shape(leaf.shape[1:], transpose)
            out[f"model.layers.{i}.{suffix}"] = _Entry(("layers", *path), i, transpose, shape)
    return out


def _hf_shape(shape: tuple[int, ...], transpose: bool) -> tuple[int, ...]:
    return tuple(reversed(shape)) if transpose else tuple(shape)


def _get(tree: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(tree, Mapping) or key not in tree:
            return None
        tree = tree[key]
    return tree


def _numpy_dtype(dtype: Any) -> np.dtype:
    try:
        result = np.dtype(dtype)
    except TypeError as error:
        raise TypeError(f"dtype is {dtype!r}; expected float32, bfloat16 or float16") from error
    if result not in (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16)):
        raise ValueError(f"dtype is {result}; expected float32, bfloat16 or float16")
    return result


# ---------------------------------------------------------------- reading


@contextlib.contextmanager
def _open_tensors(directory: Path) -> Iterator[dict[str, Callable[[], np.ndarray]]]:
    """Yields {tensor name: loader} over a single-file or sharded safetensors checkpoint."""
    from safetensors import safe_open

    single, index = directory / SINGLE_FILE, directory / INDEX_FILE
    if single.is_file():
        files = {SINGLE_FILE: None}
    elif index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise ValueError(f"{index} has no valid 'weight_map': {error}") from error
        files = {name: None for name in sorted(set(weight_map.values()))}
    else:
        raise FileNotFoundError(
            f"checkpoint directory {directory} has neither {SINGLE_FILE} nor {INDEX_FILE} "
            "(only safetensors checkpoints are read)"
        )
    with contextlib.ExitStack() as stack:
        loaders: dict[str, Callable[[], np.ndarray]] = {}
        for file in files:
            if not (directory / file).is_file():
                raise FileNotFoundError(f"{index} lists shard {file}, which is missing")
            handle = stack.enter_context(_safe_open(safe_open, directory / file))
            for name in handle.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                loaders[name] = lambda handle=handle, name=name: handle.get_tensor(name)
        if index.is_file() and not single.is_file():
            absent = sorted(set(weight_map) - set(loaders))
            if absent:
                raise ValueError(
                    f"tensor {absent[0]!r} is listed in {index} but absent from its shard "
                    f"{weight_map[absent[0]]} ({len(absent)} such tensors)"
                )
        yield loaders


def _safe_open(safe_open: Callable[..., Any], path: Path) -> Any:
    """``safe_open`` on one file; its bare header errors name the file and its size."""
    try:
        return safe_open(str(path), framework="numpy")
    except Exception as error:  # safetensors' SafetensorError: no file name, no hint
        raise ValueError(
            f"{path} ({path.stat().st_size} bytes) is not a readable safetensors file; it looks "
            f"truncated or corrupt ({error})"
        ) from error


def _read_params(
    model: CausalTransformer, loaders: Mapping[str, Callable[[], np.ndarray]], where: Path
) -> dict[str, Any]:
    cfg = model.config
    entries = _entries(model)
    names = {n for n in loaders if not n.endswith(_IGNORED_SUFFIXES)}
    missing = sorted(set(entries) - names)
    if missing:
        raise ValueError(
            f"checkpoint {where} is missing tensor {missing[0]!r} ({len(missing)} missing in all)"
        )
    unexpected = sorted(names - set(entries))
    if cfg.tie_embeddings and "lm_head.weight" in unexpected:
        embed, head = loaders["model.embed_tokens.weight"](), loaders["lm_head.weight"]()
        if embed.shape != head.shape or not np.array_equal(embed, head):
            raise ValueError(
                f"checkpoint {where} has an lm_head.weight that differs from "
                "model.embed_tokens.weight, but its config ties the embeddings"
            )
        unexpected.remove("lm_head.weight")
    if unexpected:
        raise ValueError(
            f"checkpoint {where} has unexpected tensor {unexpected[0]!r} "
            f"({len(unexpected)} unexpected in all)"
        )
    dtype = np.dtype(cfg.param_dtype)
    stacked: dict[tuple[str, ...], list[np.ndarray | None]] = {}
    params: dict[str, Any] = {}
    for name, entry in entries.items():
        value = loaders[name]()
        if tuple(value.shape) != entry.shape:
            raise ValueError(
                f"tensor {name!r} in {where} has shape {tuple(value.shape)}; "
                f"expected {entry.shape} for this config"
            )
        value = (value.T if entry.transpose else value).astype(dtype)
        if entry.layer is None:
            _set(params, entry.path, value)
        else:
            stacked.setdefault(entry.path, [None] * cfg.num_layers)[entry.layer] = value
    for path, layers in stacked.items():
        _set(params, path, np.stack(layers))
    return {"params": jax.tree.map(jnp.asarray, params)}


def _set(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def load_pretrained(
    directory: str | os.PathLike[str],
    *,
    dtype: Any = jnp.float32,
    param_dtype: Any = jnp.float32,
    **options: Any,
) -> Pretrained:
    """Reads a transformers checkpoint of ``LlamaForCausalLM`` or ``Qwen3ForCausalLM``.

    Args:
        directory: holds ``config.json`` and ``model.safetensors`` or a sharded
            ``model.safetensors.index.json`` with its shards. Nothing is downloaded.
        dtype: the decoder's compute dtype.
        param_dtype: the dtype the weights are cast to (whatever the file stores).
        **options: other `TransformerConfig` fields, e.g. ``max_seq_len`` (default: the
            checkpoint's ``max_position_embeddings``), ``remat``, ``scan_unroll``.

    Returns:
        A `Pretrained` with ``.model``, ``.variables`` (``{"params": ...}``) and ``.config``.

    Raises:
        FileNotFoundError: no such directory, config.json or weights file.
        ValueError: an unsupported architecture or setting, a missing, unexpected or
            mis-shaped tensor (named), or a weights file that is truncated or corrupt (named).

    Example:
        >>> pretrained = load_pretrained("checkpoints/qwen3-0.6b")   # doctest: +SKIP
        >>> logits = pretrained.model.apply(pretrained.variables, tokens)   # doctest: +SKIP
    """
    path = Path(directory)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    config = hf_config.read(path)
    cfg = hf_config.to_transformer_config(config, dtype=dtype, param_dtype=param_dtype, **options)
    model = CausalTransformer(cfg)
    with _open_tensors(path) as loaders:
        variables = _read_params(model, loaders, path)
    return Pretrained(model=model, variables=variables, config=config, source=path)


# ---------------------------------------------------------------- writing


@dataclasses.dataclass(frozen=True, eq=False)
class Pretrained:
    """A decoder with Hugging Face weights: the model, its variables and its transformers config.

    Attributes:
        model: the `CausalTransformer`.
        variables: ``{"params": ...}`` as loaded (or as given to `from_model`).
        config: the transformers config (``LlamaConfig`` / ``Qwen3Config``) that `save`
            writes as config.json.
        source: the directory it was loaded from, if any; `save` copies the tokenizer and
            generation files found there.

    Example:
        >>> pretrained = load_pretrained("checkpoints/qwen3-0.6b")   # doctest: +SKIP
        >>> pretrained.save(state.params, "out/step-100", dtype=jnp.bfloat16)   # doctest: +SKIP
    """

    model: CausalTransformer
    variables: Any
    config: Any
    source: Path | None = None

    @classmethod
    def from_model(
        cls,
        model: CausalTransformer,
        variables: Any,
        *,
        architecture: str | None = None,
        **config: Any,
    ) -> Pretrained:
        """Wraps a decoder built with `dew_pipe.models.build` so it can be saved for transformers.

        Args:
            model: the decoder.
            variables: its ``{"params": ...}``.
            architecture: ``"LlamaForCausalLM"`` or ``"Qwen3ForCausalLM"``; None picks Qwen3
                for a model with q/k norm, Llama otherwise.
            **config: extra transformers config fields (``eos_token_id``, ...).

        Raises:
            ValueError: the architecture does not fit the model.
        """
        hf = hf_config.from_transformer_config(model.config, architecture, **config)
        return cls(model=model, variables=variables, config=hf)

    def _default_dtype(self) -> np.dtype:
        stored = getattr(self.config, "dtype", None)
        if stored is not None:
            with contextlib.suppress(TypeError, ValueError):
                return _numpy_dtype(str(stored).removeprefix("torch."))
        return np.dtype(self.model.config.param_dtype)

    def export(self, variables: Any, *, dtype: Any = None) -> dict[str, np.ndarray]:
        """The tensors `save` writes, by transformers name, as host NumPy arrays.

        Args:
            variables: ``{"params": ...}`` of this model (for example ``state.params``).
            dtype: float32, bfloat16 or float16; None keeps the checkpoint's dtype (the
                config's ``dtype``), or the parameters' own for a model without one.

        Returns:
            ``{name: array}`` in transformers' ``[out, in]`` layout, C-contiguous.

        Raises:
            ValueError: variables that do not fit the model (a path or shape named).
        """
        target = self._default_dtype() if dtype is None else _numpy_dtype(dtype)
        params = variables.get("params") if isinstance(variables, Mapping) else None
        if params is None:
            raise ValueError("variables has no 'params' collection; expected {'params': ...}")
        out: dict[str, np.ndarray] = {}
        host: dict[tuple[str, ...], np.ndarray] = {}  # one device-to-host copy per leaf
        for name, entry in _entries(self.model).items():
            if entry.path not in host:
                leaf = _get(params, entry.path)
                if leaf is None:
                    raise ValueError(f"variables lack params/{'/'.join(entry.path)} (for {name})")
                host[entry.path] = np.asarray(jax.device_get(leaf))
            value = host[entry.path]
            full_shape = value.shape
            if entry.layer is not None:
                value = value[entry.layer] if value.ndim == len(entry.shape) + 1 else None
            if value is None or _hf_shape(value.shape, entry.transpose) != entry.shape:
                raise ValueError(
                    f"params/{'/'.join(entry.path)} has shape {full_shape}; it does not "
                    f"give {name} its shape {entry.shape}"
                )
            value = value.T if entry.transpose else value
            out[name] = np.ascontiguousarray(value.astype(target))
        return out

    def save(
        self,
        variables: Any,
        directory: str | os.PathLike[str],
        *,
        dtype: Any = None,
        max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    ) -> list[Path]:
        """Writes a transformers checkpoint: config.json, weights, and companion files.

        Weights go to ``model.safetensors``, or, when they exceed ``max_shard_bytes``, to
        ``model-0000k-of-0000n.safetensors`` shards with a ``model.safetensors.index.json``.
        Weight files of an earlier save in ``directory`` that this save does not rewrite are
        removed, so loaders never see a stale mix. Each file is written beside its final
        name and moved in with ``os.replace``.

        Args:
            variables: ``{"params": ...}`` of this model.
            directory: created if missing.
            dtype: as in `export`; config.json records it.
            max_shard_bytes: the largest shard (a single larger tensor gets its own).

        Returns:
            The paths written.

        Raises:
            ValueError: variables that do not fit the model, or a bad ``max_shard_bytes``.
        """
        from safetensors.numpy import save_file

        max_shard_bytes = check_int("max_shard_bytes", max_shard_bytes, minimum=1)
        tensors = self.export(variables, dtype=dtype)
        target = Path(directory)
        target.mkdir(parents=True, exist_ok=True)
        shards = _shard(tensors, max_shard_bytes)
        written: list[Path] = []
        for file, names in shards.items():
            part = {name: tensors[name] for name in names}
            written.append(
                write_atomic(
                    target / file, lambda p, part=part: save_file(part, p, {"format": "pt"})
                )
            )
        if len(shards) > 1:
            index = {
                "metadata": {"total_size": int(sum(t.nbytes for t in tensors.values()))},
                "weight_map": {name: file for file, names in shards.items() for name in names},
            }
            text = json.dumps(index, indent=2, sort_keys=True) + "\n"
            written.append(write_atomic(target / INDEX_FILE, lambda p: Path(p).write_text(text)))
        _remove_stale(target, set(shards) | ({INDEX_FILE} if len(shards) > 1 else set()))
        config = self.config.__class__.from_dict(self.config.to_dict())
        config.dtype = str(next(iter(tensors.values())).dtype)
        text = _with_legacy_keys(config.to_json_string(use_diff=True))
        written.append(write_atomic(target / "config.json", lambda p: Path(p).write_text(text)))
        written += self._copy_companions(target)
        return written

    def _copy_companions(self, target: Path) -> list[Path]:
        if self.source is None or self.source.resolve() == target.resolve():
            return []
        copied = []
        for name in _COMPANIONS:
            if (self.source / name).is_file():
                copied.append(
                    write_atomic(
                        target / name, lambda p, n=name: shutil.copyfile(self.source / n, p)
                    )
                )
        return copied


def _with_legacy_keys(text: str) -> str:
    """Adds the pre-5.0 spellings (``rope_theta``, ``rope_scaling``, ``torch_dtype``) to a
    transformers 5 config.json, so servers built on transformers 4 (older vLLM and SGLang)
    read the same rotary base and dtype instead of silently falling back to defaults.
    transformers 5 reads either spelling."""
    config = json.loads(text)
    rope = dict(config.get("rope_parameters") or {})
    if "rope_theta" in rope:
        config["rope_theta"] = rope.pop("rope_theta")
        config["rope_scaling"] = None if rope.get("rope_type", "default") == "default" else rope
    if "dtype" in config:
        config["torch_dtype"] = config["dtype"]
    return json.dumps(config, indent=2, sort_keys=True) + "\n"


def _shard(tensors: Mapping[str, np.ndarray], limit: int) -> dict[str, list[str]]:
    """Groups tensor names into files of at most ``limit`` bytes, in transformers' order."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, value in tensors.items():
        if groups[-1] and size + value.nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += value.nbytes
    if len(groups) == 1:
        return {SINGLE_FILE: groups[0]}
    n = len(groups)
    return {f"model-{k + 1:05d}-of-{n:05d}.safetensors": names for k, names in enumerate(groups)}


def _remove_stale(directory: Path, keep: set[str]) -> None:
    for path in directory.iterdir():
        name = path.name
        is_weights = name in (SINGLE_FILE, INDEX_FILE) or (
            name.startswith("model-") and name.endswith(".safetensors")
        )
        if is_weights and name not in keep:
            path.unlink()
