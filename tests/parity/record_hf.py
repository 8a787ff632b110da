"""Records Hugging Face Llama/Qwen3 fixtures for tests/test_hf.py (in the reference env).

Two modes, both deterministic (fixed seeds, float32, eager attention, one CPU thread):

``record``: builds tiny random ``LlamaForCausalLM`` and ``Qwen3ForCausalLM`` models (GQA,
q/k norm, tied and untied heads, Llama 3.1 rope scaling, a sharded save), saves each with
``save_pretrained`` under ``fixtures/hf/<name>/``, and records float32 logits in
``fixtures/hf/<name>/logits.npz``:

- ``tokens`` [2, 12] → ``logits``: ordinary unpadded rows.
- ``packed_tokens`` / ``packed_positions`` / ``packed_segments`` [2, 16] → ``packed_logits``:
  several documents per row with positions restarting at 0. transformers 5 (masking_utils)
  detects the restarts in ``position_ids`` when ``attention_mask`` is None and builds a
  block-diagonal causal mask; the script checks that this equals running every document
  on its own (max difference printed), and records transformers' packed output. Segment 0
  marks the padding tail, whose logits the tests ignore.

``roundtrip``: runs ``tests/parity/hf_saves.py`` with the project's interpreter to write checkpoints
with ``Pretrained.save`` (float32, bfloat16, sharded, and decoders built by dew_pipe),
loads each with ``AutoModelForCausalLM.from_pretrained`` and records in
``fixtures/hf/roundtrip.json`` the files' SHA-256, config.json, tensor names/shapes/dtypes,
transformers' missing/unexpected/mismatched keys, whether the weights equal the source
model's (cast to the saved dtype) and the largest logit difference. transformers' logits of
the built decoders go to ``fixtures/hf/roundtrip_logits.npz``.

Re-run from the repository root, in the reference environment (torch + transformers; build
it with ``benchmarks/reference_env.sh``, which creates ``.reference-venv/``)::

    .reference-venv/bin/python tests/parity/record_hf.py record
    .reference-venv/bin/python tests/parity/record_hf.py roundtrip   # needs record first

``--dev-python`` points at the project's own interpreter, the one with dew_pipe and JAX
(default ``.venv/bin/python`` at the repository root, as the README sets it up).
Re-run ``roundtrip`` whenever ``Pretrained.save``'s output changes (test_hf.py says so).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors import safe_open

HERE = Path(__file__).resolve().parent
OUT = HERE / "fixtures" / "hf"

# name -> (config class, config fields, max_shard_size for save_pretrained)
MODELS = {
    "llama_gqa_untied": (
        "LlamaConfig",
        dict(num_key_value_heads=2, tie_word_embeddings=False, rms_norm_eps=1e-5),
        None,
    ),
    "llama_tied_llama3_rope": (
        "LlamaConfig",
        dict(
            num_key_value_heads=4,
            tie_word_embeddings=True,
            max_position_embeddings=512,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=4.0,
                low_freq_factor=1.0,
                high_freq_factor=8.0,
                original_max_position_embeddings=256,
            ),
        ),
        None,
    ),
    "qwen3_gqa_tied": (
        "Qwen3Config",
        dict(
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=True,
            rope_parameters=dict(rope_type="default", rope_theta=1e6),
        ),
        None,
    ),
    "qwen3_untied_sharded": (
        "Qwen3Config",
        dict(num_key_value_heads=1, head_dim=8, tie_word_embeddings=False),
        "40KB",
    ),
}
COMMON = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
DOCS = ([5, 4, 6], [9, 7])  # document lengths of the two packed rows (width 16)
WIDTH = 16


def build(name: str, seed: int) -> torch.nn.Module:
    cls_name, fields, _ = MODELS[name]
    config = getattr(transformers, cls_name)(**{**COMMON, **fields}, architectures=None)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():  # larger weights than the 0.02 initialiser, norms away from one
        for pname, param in model.named_parameters():
            if "norm" in pname:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif "embed_tokens" in pname:
                param.copy_(0.5 * torch.randn_like(param))
            else:
                param.copy_(torch.randn_like(param) / param.shape[1] ** 0.5)
    return model.eval()


def packed_inputs(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    tokens = rng.integers(3, COMMON["vocab_size"], (2, WIDTH)).astype(np.int64)
    positions = np.zeros((2, WIDTH), np.int64)
    segments = np.zeros((2, WIDTH), np.int32)
    for row, lengths in enumerate(DOCS):
        start = 0
        for doc, length in enumerate(lengths, 1):
            positions[row, start : start + length] = np.arange(length)
            segments[row, start : start + length] = doc
            start += length
        tokens[row, start:] = COMMON["pad_token_id"]
    return tokens, positions, segments


@torch.no_grad()
def record(seed: int = 0) -> None:
    torch.set_num_threads(1)
    for index, name in enumerate(MODELS):
        model = build(name, seed + index)
        directory = OUT / name
        shutil.rmtree(directory, ignore_errors=True)
        shard = MODELS[name][2]
        model.save_pretrained(directory, **({"max_shard_size": shard} if shard else {}))
        rng = np.random.default_rng(100 + index)
        tokens = rng.integers(0, COMMON["vocab_size"], (2, 12)).astype(np.int64)
        logits = model(torch.from_numpy(tokens)).logits.numpy()
        packed, positions, segments = packed_inputs(rng)
        packed_logits = model(
            torch.from_numpy(packed), position_ids=torch.from_numpy(positions), use_cache=False
        ).logits.numpy()
        gap = 0.0
        for row in range(2):
            for doc in range(1, segments[row].max() + 1):
                cols = np.flatnonzero(segments[row] == doc)
                alone = model(torch.from_numpy(packed[row : row + 1, cols])).logits.numpy()[0]
                gap = max(gap, float(np.abs(alone - packed_logits[row, cols]).max()))
        assert gap < 1e-5, (
            f"{name}: transformers' packed path differs from documents alone by {gap}"
        )
        np.savez(
            directory / "logits.npz",
            tokens=tokens.astype(np.int32),
            logits=logits.astype(np.float32),
            packed_tokens=packed.astype(np.int32),
            packed_positions=positions.astype(np.int32),
            packed_segments=segments,
            packed_logits=packed_logits.astype(np.float32),
        )
        files = sorted(p.name for p in directory.iterdir())
        size = sum(p.stat().st_size for p in directory.iterdir())
        print(f"{name}: {files} ({size} bytes), packed vs alone max diff {gap:.2e}")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _tensors(directory: Path) -> dict[str, list]:
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118
                piece = handle.get_slice(key)
                out[key] = [list(piece.get_shape()), piece.get_dtype()]
    return dict(sorted(out.items()))


@torch.no_grad()
def check_variant(directory: Path, entry: dict, built_logits: dict) -> dict:
    """Loads one dew_pipe-written checkpoint with transformers and compares it."""
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        directory, output_loading_info=True, attn_implementation="eager", dtype="auto"
    )
    model.eval()
    result = {
        key: sorted(map(str, info.get(key, [])))
        for key in ("missing_keys", "unexpected_keys", "mismatched_keys")
    }
    config = json.loads((directory / "config.json").read_text())
    config.pop("transformers_version", None)
    result.update(
        files={p.name: _sha256(p) for p in sorted(directory.iterdir()) if p.name != "config.json"},
        index=(directory / "model.safetensors.index.json").is_file(),
        config=config,
        tensors=_tensors(directory),
        loaded_dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
    )
    if entry["fixture"] is None:
        dew = np.load(directory.parent / f"{entry['variant']}.logits.npy")
        tokens = torch.from_numpy(np.asarray(_built_tokens(), np.int64))
        theirs = model(tokens).logits.float().numpy()
        built_logits[entry["variant"]] = theirs
        result.update(weights_equal=None, max_abs_logit_diff=float(np.abs(theirs - dew).max()))
        return result
    # The source fixture, loaded in the saved dtype through the same code path, so rotary
    # buffers and casts match and any difference comes from the saved weights alone.
    source = transformers.AutoModelForCausalLM.from_pretrained(
        OUT / entry["fixture"], attn_implementation="eager", dtype=getattr(torch, entry["dtype"])
    ).eval()
    mine, ref = model.state_dict(), source.state_dict()
    equal = mine.keys() == ref.keys() and all(torch.equal(mine[k], ref[k]) for k in ref)
    tokens = torch.from_numpy(
        np.load(OUT / entry["fixture"] / "logits.npz")["tokens"].astype(np.int64)
    )
    diff = (model(tokens).logits.float() - source(tokens).logits.float()).abs().max().item()
    result.update(weights_equal=bool(equal), max_abs_logit_diff=float(diff))
    return result


def _built_tokens():
    rng = np.random.default_rng(11)  # mirrors hf_saves.BUILT_TOKENS without importing jax
    return rng.integers(0, 40, (2, 9)).astype(np.int32)


def roundtrip(dev_python: str) -> None:
    torch.set_num_threads(1)
    repo = HERE.parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        done = subprocess.run(
            [dev_python, str(HERE / "hf_saves.py"), str(OUT), str(out)],
            check=True,
            capture_output=True,
            text=True,
            cwd=repo,
        )
        entries = json.loads(done.stdout.strip().splitlines()[-1])
        results, built_logits = {}, {}
        for entry in entries:
            result = check_variant(out / entry["variant"], entry, built_logits)
            results[entry["variant"]] = result
            print(
                f"{entry['variant']}: missing {result['missing_keys']}, unexpected "
                f"{result['unexpected_keys']}, weights equal {result['weights_equal']}, "
                f"logit diff {result['max_abs_logit_diff']:.2e}, loaded as {result['loaded_dtype']}"
            )
    meta = dict(transformers=transformers.__version__, torch=torch.__version__)
    (OUT / "roundtrip.json").write_text(
        json.dumps({"versions": meta, "variants": results}, indent=1, sort_keys=True) + "\n"
    )
    np.savez(OUT / "roundtrip_logits.npz", **built_logits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=("record", "roundtrip"))
    parser.add_argument(
        "--dev-python", default=str(HERE.parent.parent / ".venv" / "bin" / "python")
    )
    args = parser.parse_args()
    if args.mode == "record":
        record()
    else:
        roundtrip(args.dev_python)


if __name__ == "__main__":
    main()
