"""Checkpoints written by `Pretrained.save`, for the transformers round trip (dew_pipe side).

The parity script (record_hf.py, in the reference environment) runs this file with the
project's own interpreter to get
checkpoints dew_pipe wrote, loads them with transformers and records what it saw in
``fixtures/hf/roundtrip.json``. tests/test_hf.py imports it to write the very same
checkpoints again and checks that they are byte-identical to the ones transformers checked.

Usage: ``.venv/bin/python tests/parity/hf_saves.py FIXTURES_HF_DIR OUT_DIR``; prints a
JSON list of the variants written.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from dew_pipe import models

# variant -> (fixture it reloads, save dtype, max_shard_bytes)
FROM_FIXTURES = {
    "llama_gqa_untied-float32": ("llama_gqa_untied", "float32", None),
    "llama_tied_llama3_rope-float32": ("llama_tied_llama3_rope", "float32", None),
    "qwen3_gqa_tied-float32": ("qwen3_gqa_tied", "float32", None),
    "qwen3_untied_sharded-float32": ("qwen3_untied_sharded", "float32", None),
    "qwen3_gqa_tied-bfloat16": ("qwen3_gqa_tied", "bfloat16", None),
    "llama_gqa_untied-sharded": ("llama_gqa_untied", "float32", 20_000),
}
# variant -> build options of a decoder made by dew_pipe itself (no Hugging Face origin)
BUILT = {
    "built_llama-float32": dict(
        vocab_size=40,
        emb_features=24,
        num_layers=2,
        num_heads=6,
        num_kv_heads=2,
        mlp_features=40,
        max_seq_len=32,
        rope_theta=1000.0,
        rope_scaling=dict(kind="linear", factor=2.0),
    ),
    "built_qwen3-float32": dict(
        vocab_size=40,
        emb_features=24,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=10,
        mlp_features=40,
        max_seq_len=32,
        qk_norm=True,
        tie_embeddings=True,
    ),
}
BUILT_TOKENS = np.random.default_rng(11).integers(0, 40, (2, 9)).astype(np.int32)


def built_variables(model, seed: int = 5):
    """Deterministic NumPy weights for a built decoder (no JAX RNG, so stable across versions)."""
    import jax

    shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 1), jnp.int32))
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        is_scale = any(getattr(p, "key", None) == "scale" for p in path)
        noise = rng.normal(size=leaf.shape)
        return jnp.asarray(1.0 + 0.2 * noise if is_scale else 0.3 * noise, leaf.dtype)

    return jax.tree_util.tree_map_with_path(draw, shapes)


def write_variants(fixtures: Path, out: Path, logits: bool = True) -> list[dict]:
    """Writes every variant under ``out/<variant>`` (and the built decoders' logits on
    `BUILT_TOKENS` as ``out/<variant>.logits.npy`` when ``logits``); returns descriptions."""
    written = []
    for variant, (name, dtype, shard) in FROM_FIXTURES.items():
        pretrained = models.load_pretrained(fixtures / name)
        options = {} if shard is None else {"max_shard_bytes": shard}
        pretrained.save(pretrained.variables, out / variant, dtype=dtype, **options)
        written.append(dict(variant=variant, fixture=name, dtype=dtype))
    for variant, options in BUILT.items():
        model = models.build("causal_transformer", **options)
        variables = built_variables(model)
        models.Pretrained.from_model(model, variables, eos_token_id=1).save(
            variables, out / variant
        )
        if logits:
            np.save(out / f"{variant}.logits.npy", np.asarray(model.apply(variables, BUILT_TOKENS)))
        written.append(dict(variant=variant, fixture=None, dtype="float32"))
    return written


if __name__ == "__main__":
    print(json.dumps(write_variants(Path(sys.argv[1]), Path(sys.argv[2]))))
