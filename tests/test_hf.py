"""Hugging Face checkpoints: logits against transformers, save → transformers round trip, errors.

Fixtures come from tests/parity/record_hf.py (torch venv): tiny random Llama and Qwen3
models saved by transformers with their logits, and roundtrip.json, in which transformers
loaded checkpoints written by `Pretrained.save` (see tests/parity/hf_saves.py). Here we
write those checkpoints again and require the same bytes, so what transformers checked is
what `save` writes today.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from dew_pipe import models
from dew_pipe.models import Pretrained, load_pretrained

PARITY = Path(__file__).parent / "parity"
HF = PARITY / "fixtures" / "hf"
NAMES = ("llama_gqa_untied", "llama_tied_llama3_rope", "qwen3_gqa_tied", "qwen3_untied_sharded")
RERECORD = "re-run `.reference-venv/bin/python tests/parity/record_hf.py roundtrip`"


def _hf_saves():
    spec = importlib.util.spec_from_file_location("hf_saves", PARITY / "hf_saves.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def loaded():
    return {name: load_pretrained(HF / name) for name in NAMES}


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(loaded, name):
    pretrained = loaded[name]
    expected = np.load(HF / name / "logits.npz")
    forward = jax.jit(pretrained.model.apply)
    got = forward(pretrained.variables, expected["tokens"])
    np.testing.assert_allclose(np.asarray(got), expected["logits"], rtol=0, atol=1e-4)
    segments = expected["packed_segments"]
    packed = forward(
        pretrained.variables,
        expected["packed_tokens"],
        segments,
        expected["packed_positions"],
    )
    real = segments > 0
    assert (~real).any()  # the padding tail exists and is excluded
    np.testing.assert_allclose(
        np.asarray(packed)[real], expected["packed_logits"][real], rtol=0, atol=1e-4
    )


def test_configs_are_translated(loaded):
    qwen = loaded["qwen3_gqa_tied"].model.config
    assert (qwen.qk_norm, qwen.tie_embeddings, qwen.head_dim, qwen.num_kv_heads) == (
        True,
        True,
        16,
        2,
    )
    assert qwen.rope_theta == 1e6 and qwen.max_seq_len == 64
    llama = loaded["llama_tied_llama3_rope"].model.config
    assert llama.rope_scaling == models.RopeScaling("llama3", 4.0, 1.0, 8.0, 256)
    assert not llama.qk_norm and llama.num_kv_heads == llama.num_heads == 4
    untied = loaded["llama_gqa_untied"]
    assert untied.model.config.norm_eps == 1e-5 and "lm_head" in untied.variables["params"]
    assert untied.config.eos_token_id == 2  # the transformers config travels along
    assert loaded["llama_gqa_untied"].variables["params"]["layers"]["attn"]["q"].shape == (
        2,
        32,
        32,
    )


def test_load_options_set_dtypes_and_context():
    pretrained = load_pretrained(
        HF / "qwen3_gqa_tied", param_dtype=jnp.bfloat16, dtype=jnp.bfloat16, max_seq_len=16
    )
    assert pretrained.model.config.max_seq_len == 16
    leaves = jax.tree.leaves(pretrained.variables)
    assert {leaf.dtype for leaf in leaves} == {jnp.dtype(jnp.bfloat16)}


# ---------------------------------------------------------------- save and export


def _tensor_specs(directory: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="numpy") as handle:
            for key in handle.keys():  # noqa: SIM118
                piece = handle.get_slice(key)
                out[key] = (tuple(piece.get_shape()), piece.get_dtype())
    return out


LEGACY = ("rope_theta", "rope_scaling", "torch_dtype")


def _config(directory: Path, legacy: bool = True) -> dict:
    config = json.loads((directory / "config.json").read_text())
    config.pop("transformers_version", None)
    if not legacy:
        for key in LEGACY:
            config.pop(key, None)
    return config


@pytest.mark.parametrize("name", NAMES)
def test_float32_save_reproduces_what_transformers_wrote(loaded, name, tmp_path):
    pretrained = loaded[name]
    pretrained.save(pretrained.variables, tmp_path)
    assert _tensor_specs(tmp_path) == _tensor_specs(HF / name)
    ours = _config(tmp_path)
    assert _config(tmp_path, legacy=False) == _config(HF / name)
    # Pre-5.0 spellings for servers on transformers 4, consistent with the new ones:
    rope = dict(ours["rope_parameters"])
    assert ours["rope_theta"] == rope.pop("rope_theta") and ours["torch_dtype"] == "float32"
    assert ours["rope_scaling"] == (None if rope["rope_type"] == "default" else rope)
    theirs = {}
    for file in (HF / name).glob("*.safetensors"):
        theirs.update(load_file(file))
    ours = load_file(tmp_path / "model.safetensors")
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        np.testing.assert_array_equal(ours[key], value, err_msg=key)
    assert (tmp_path / "generation_config.json").is_file()  # companions travel along


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def rewritten(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf_saves")
    entries = _hf_saves().write_variants(HF, out, logits=False)
    return out, entries


def test_roundtrip_record_covers_every_variant(rewritten):
    _, entries = rewritten
    recorded = json.loads((HF / "roundtrip.json").read_text())["variants"]
    assert sorted(e["variant"] for e in entries) == sorted(recorded), RERECORD


@pytest.mark.parametrize(
    "variant",
    sorted(json.loads((HF / "roundtrip.json").read_text())["variants"]),
)
def test_saved_checkpoints_are_what_transformers_loaded(rewritten, variant):
    out, _ = rewritten
    record = json.loads((HF / "roundtrip.json").read_text())["variants"][variant]
    directory = out / variant
    files = {p.name: _sha256(p) for p in sorted(directory.iterdir()) if p.name != "config.json"}
    assert files == record["files"], f"Pretrained.save output changed; {RERECORD}"
    assert _config(directory) == record["config"]
    specs = {k: [list(shape), dtype] for k, (shape, dtype) in _tensor_specs(directory).items()}
    assert specs == record["tensors"]
    # What transformers reported when it loaded these very bytes:
    assert record["missing_keys"] == record["unexpected_keys"] == record["mismatched_keys"] == []
    assert record["loaded_dtype"] == record["config"]["dtype"]
    assert record["index"] == (directory / "model.safetensors.index.json").is_file()
    if record["weights_equal"] is not None:
        assert record["weights_equal"] is True
    assert record["max_abs_logit_diff"] <= 1e-4


def test_sharded_and_bfloat16_variants_look_right(rewritten):
    out, _ = rewritten
    sharded = out / "llama_gqa_untied-sharded"
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in sharded.glob("model-*.safetensors"))
    assert len(shards) > 1 and sorted(set(index["weight_map"].values())) == shards
    assert not (sharded / "model.safetensors").exists()
    sizes = {s: (sharded / s).stat().st_size for s in shards}
    assert max(sizes.values()) < 20_000 + 4_096  # limit plus a safetensors header
    total = sum(np.prod(shape) * 4 for shape, _ in _tensor_specs(sharded).values())
    assert index["metadata"]["total_size"] == total
    bf16 = out / "qwen3_gqa_tied-bfloat16"
    assert {dtype for _, dtype in _tensor_specs(bf16).values()} == {"BF16"}
    assert _config(bf16)["dtype"] == "bfloat16"


@pytest.mark.parametrize("variant", ["built_llama-float32", "built_qwen3-float32"])
def test_built_decoders_match_transformers_logits(variant):
    saves = _hf_saves()
    model = models.build("causal_transformer", **saves.BUILT[variant])
    variables = saves.built_variables(model)
    theirs = np.load(HF / "roundtrip_logits.npz")[variant]
    ours = jax.jit(model.apply)(variables, saves.BUILT_TOKENS)
    np.testing.assert_allclose(np.asarray(ours), theirs, rtol=0, atol=1e-4)


def test_export_names_layouts_and_dtypes(loaded):
    pretrained = loaded["qwen3_gqa_tied"]
    tensors = pretrained.export(pretrained.variables)
    assert set(tensors) == set(_tensor_specs(HF / "qwen3_gqa_tied"))
    assert "lm_head.weight" not in tensors  # tied
    q = np.asarray(pretrained.variables["params"]["layers"]["attn"]["q"])
    np.testing.assert_array_equal(tensors["model.layers.1.self_attn.q_proj.weight"], q[1].T)
    assert tensors["model.layers.1.self_attn.q_proj.weight"].flags.c_contiguous
    half = pretrained.export(pretrained.variables, dtype=jnp.bfloat16)
    key = "model.layers.0.mlp.up_proj.weight"
    assert half[key].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(half[key], tensors[key].astype(ml_dtypes.bfloat16))


def test_save_replaces_stale_weight_files(loaded, tmp_path):
    pretrained = loaded["llama_gqa_untied"]
    pretrained.save(pretrained.variables, tmp_path, max_shard_bytes=20_000)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    written = pretrained.save(pretrained.variables, tmp_path)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert "model.safetensors" in names and not any(n.startswith("model-") for n in names)
    assert "model.safetensors.index.json" not in names
    assert all(p.exists() for p in written)
    assert not [n for n in names if n.startswith(".")]  # no temporary files left behind


def test_a_built_model_round_trips_through_save_and_load(tmp_path):
    saves = _hf_saves()
    model = models.build("causal_transformer", **saves.BUILT["built_qwen3-float32"])
    variables = saves.built_variables(model)
    Pretrained.from_model(model, variables).save(variables, tmp_path)
    again = load_pretrained(tmp_path)
    assert again.model.config == model.config
    for a, b in zip(jax.tree.leaves(again.variables), jax.tree.leaves(variables), strict=True):
        np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------- errors


def _copy(name: str, tmp_path: Path) -> Path:
    target = tmp_path / name
    shutil.copytree(HF / name, target)
    return target


def _edit_config(directory: Path, **changes) -> None:
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))


def _edit_tensors(directory: Path, edit) -> None:
    tensors = load_file(directory / "model.safetensors")
    edit(tensors)
    save_file(tensors, directory / "model.safetensors", {"format": "pt"})


def test_unknown_architecture_and_unsupported_settings_are_refused(tmp_path):
    directory = _copy("llama_gqa_untied", tmp_path)
    _edit_config(directory, architectures=["MistralForCausalLM"], model_type="mistral")
    with pytest.raises(ValueError, match="architectures \\['MistralForCausalLM'\\]; expected"):
        load_pretrained(directory)
    _edit_config(directory, architectures=["LlamaForCausalLM"], model_type="llama")
    _edit_config(directory, attention_bias=True)
    with pytest.raises(ValueError, match="attention_bias is True"):
        load_pretrained(directory)
    _edit_config(directory, attention_bias=False, hidden_act="gelu")
    with pytest.raises(ValueError, match="hidden_act is 'gelu'"):
        load_pretrained(directory)
    _edit_config(
        directory,
        hidden_act="silu",
        rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4},
    )
    with pytest.raises(ValueError, match="rope_type is 'yarn'"):
        load_pretrained(directory)


def test_missing_unexpected_and_misshapen_tensors_are_named(tmp_path):
    directory = _copy("llama_gqa_untied", tmp_path)
    _edit_tensors(directory, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match="missing tensor 'model.layers.1.mlp.up_proj.weight'"):
        load_pretrained(directory)
    directory = _copy("qwen3_gqa_tied", tmp_path / "b")
    _edit_tensors(directory, lambda t: t.update({"model.extra.weight": np.zeros(2, np.float32)}))
    with pytest.raises(ValueError, match="unexpected tensor 'model.extra.weight'"):
        load_pretrained(directory)
    directory = _copy("qwen3_gqa_tied", tmp_path / "c")
    key = "model.layers.0.self_attn.k_norm.weight"
    _edit_tensors(directory, lambda t: t.update({key: np.ones(12, np.float32)}))
    with pytest.raises(
        ValueError, match=f"tensor '{key}' .* has shape \\(12,\\); expected \\(16,\\)"
    ):
        load_pretrained(directory)


def test_tied_head_and_old_rotary_buffers(tmp_path):
    directory = _copy("qwen3_gqa_tied", tmp_path)
    buffer = "model.layers.0.self_attn.rotary_emb.inv_freq"

    def add(tensors):
        tensors[buffer] = np.ones(8, np.float32)  # old transformers wrote these; ignored
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()

    _edit_tensors(directory, add)
    pretrained = load_pretrained(directory)
    assert "lm_head" not in pretrained.variables["params"]
    _edit_tensors(directory, lambda t: t.update({"lm_head.weight": t["lm_head.weight"] + 1}))
    with pytest.raises(ValueError, match="lm_head.weight that differs from model.embed_tokens"):
        load_pretrained(directory)


def test_missing_files_are_reported(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_pretrained(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_pretrained(tmp_path)
    directory = _copy("llama_gqa_untied", tmp_path / "a")
    (directory / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor"):
        load_pretrained(directory)
    directory = _copy("qwen3_untied_sharded", tmp_path / "b")
    (directory / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="lists shard model-00002-of-00003.safetensors"):
        load_pretrained(directory)


def test_save_and_export_refuse_bad_arguments(loaded, tmp_path):
    pretrained = loaded["llama_gqa_untied"]
    params = pretrained.variables["params"]
    with pytest.raises(ValueError, match="no 'params' collection"):
        pretrained.export(params)
    broken = {"params": {k: v for k, v in params.items() if k != "lm_head"}}
    with pytest.raises(ValueError, match="variables lack params/lm_head \\(for lm_head.weight\\)"):
        pretrained.export(broken)
    bad = {"params": {**params, "embed": params["embed"][:, :8]}}
    with pytest.raises(ValueError, match="params/embed has shape \\(96, 8\\)"):
        pretrained.export(bad)
    with pytest.raises(ValueError, match="dtype is int32"):
        pretrained.export(pretrained.variables, dtype=np.int32)
    with pytest.raises(ValueError, match="max_shard_bytes is 0"):
        pretrained.save(pretrained.variables, tmp_path, max_shard_bytes=0)
    model = loaded["qwen3_gqa_tied"].model
    with pytest.raises(ValueError, match="LlamaForCausalLM has no q/k norm"):
        Pretrained.from_model(model, None, architecture="LlamaForCausalLM")


def test_pre_5_config_spellings_are_read(tmp_path, loaded):
    """Hub checkpoints written by transformers 4 (rope_theta/rope_scaling/torch_dtype)."""
    for name in ("qwen3_gqa_tied", "llama_tied_llama3_rope"):
        directory = _copy(name, tmp_path / name)
        config = json.loads((directory / "config.json").read_text())
        rope = config.pop("rope_parameters")
        config["rope_theta"] = rope.pop("rope_theta")
        config["rope_scaling"] = None if rope["rope_type"] == "default" else rope
        config["torch_dtype"] = config.pop("dtype")
        (directory / "config.json").write_text(json.dumps(config))
        again = load_pretrained(directory)
        assert again.model.config == loaded[name].model.config
