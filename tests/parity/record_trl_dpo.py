"""Records TRL's sigmoid DPO loss, metrics and gradients for tests/test_dpo.py (reference env).

What it does, deterministically (fixed seeds, float32, eager attention, one CPU thread):

1. Builds two tiny random ``LlamaForCausalLM`` models, a policy and a reference, with weights
   larger than the 0.02 initialiser so log-probabilities differ visibly between tokens, and
   saves each with ``save_pretrained`` under ``fixtures/trl_dpo/{policy,reference}/``
   (safetensors; dew_pipe reads them with ``load_pretrained``).
2. Builds a ``DPOTrainer`` (trl 1.16; ``use_cpu=True``, ``bf16=False``, ``beta=0.1``,
   ``loss_type=["sigmoid"]``) over four text pairs in a word-level tokenizer whose tokens are
   ``t0 .. t31`` (``t0`` pads, ``t1`` ends a sequence). TRL tokenizes them itself, appends EOS
   and splits prompt from completion.
3. Collates the four pairs with the trainer's own ``DataCollatorForPreference`` (chosen rows
   first, then rejected, right-padded, completion mask from the prompt boundary), calls
   ``trainer.compute_loss`` on that batch (the entry point ``Trainer.training_step`` uses),
   backpropagates, and records:

   - ``pairs.json``: the pairs as dew_pipe ``PreferencePairs`` records (``chosen``,
     ``rejected``, ``chosen_mask``, ``rejected_mask``, read off the collated batch), the
     width ``seq_len`` and ``beta``;
   - ``dpo.npz``: ``loss``; TRL's logged metrics (``rewards/chosen``, ``rewards/rejected``,
     ``rewards/accuracies``, ``rewards/margins``, ``logps/chosen``, ``logps/rejected``); the
     per-pair summed log-probabilities of policy and reference (``compute_ref_log_probs``
     run with each model); and the gradient of every policy parameter, under
     ``grad/<transformers name>``.

Re-run from the repository root, in the reference environment (torch, transformers, TRL;
``benchmarks/reference_env.sh`` builds it as ``.reference-venv/``)::

    .reference-venv/bin/python tests/parity/record_trl_dpo.py
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers
import trl
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import DPOConfig, DPOTrainer

OUT = Path(__file__).resolve().parent / "fixtures" / "trl_dpo"
VOCAB = 32
BETA = 0.1
CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=None,
)
# (prompt, chosen, rejected) word counts of the four pairs; each answer then gets " </s>".
SHAPES = ((3, 2, 1), (2, 4, 3), (4, 1, 5), (1, 3, 3))


def tokenizer() -> PreTrainedTokenizerFast:
    # Special tokens are matched anywhere in the text, so none may be a substring of a word.
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )


def build(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG, attn_implementation="eager"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif "embed_tokens" in name:
                param.copy_(0.8 * torch.randn_like(param))
            else:
                param.copy_(1.5 * torch.randn_like(param) / param.shape[1] ** 0.5)
    return model.train()


def examples(rng: np.random.Generator) -> list[dict[str, str]]:
    def words(count: int) -> str:
        return " ".join(f"w{i}" for i in rng.integers(3, VOCAB, count))

    return [
        {"prompt": words(p), "chosen": f" {words(c)} </s>", "rejected": f" {words(r)} </s>"}
        for p, c, r in SHAPES
    ]


def record() -> None:
    torch.set_num_threads(1)
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    policy, reference = build(0), build(1)
    policy.save_pretrained(OUT / "policy")
    reference.save_pretrained(OUT / "reference")
    text = examples(np.random.default_rng(0))
    with tempfile.TemporaryDirectory() as tmp:
        args = DPOConfig(
            output_dir=tmp,
            use_cpu=True,
            bf16=False,
            beta=BETA,
            loss_type=["sigmoid"],
            report_to=[],
            max_length=None,
            dataset_num_proc=None,
            seed=0,
        )
        trainer = DPOTrainer(
            model=policy,
            ref_model=reference,
            args=args,
            train_dataset=Dataset.from_list(text),
            processing_class=tokenizer(),
        )
        rows = [trainer.train_dataset[i] for i in range(len(text))]
        batch = trainer._prepare_inputs(trainer.data_collator(rows))
        model = trainer.model
        model.train()
        model.zero_grad()
        loss = trainer.compute_loss(model, batch)
        loss.backward()
        metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()}
        with torch.no_grad():
            policy_logps = trainer.compute_ref_log_probs(model, batch)
            ref_logps = trainer.compute_ref_log_probs(trainer.ref_model, batch)
        grads = {
            f"grad/{name}": param.grad.detach().numpy().astype(np.float32)
            for name, param in model.named_parameters()
        }
    ids = batch["input_ids"].numpy()
    attention = batch["attention_mask"].numpy()
    mask = batch["completion_mask"].numpy()
    pairs = len(text)
    records = []
    for i in range(pairs):
        row = {}
        for side, r in (("chosen", i), ("rejected", pairs + i)):
            length = int(attention[r].sum())
            assert attention[r, :length].all(), "expected right padding"
            row[side] = ids[r, :length].tolist()
            row[f"{side}_mask"] = mask[r, :length].tolist()
        records.append(row)
    (OUT / "pairs.json").write_text(
        json.dumps(
            {
                "seq_len": int(ids.shape[1]),
                "beta": BETA,
                "records": records,
                "versions": {
                    "trl": trl.__version__,
                    "transformers": transformers.__version__,
                    "torch": torch.__version__,
                },
            },
            indent=1,
        )
    )
    wanted = (
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
    )
    np.savez(
        OUT / "dpo.npz",
        loss=np.float32(loss.item()),
        policy_logps=torch.stack(policy_logps, 1).numpy().astype(np.float32),
        ref_logps=torch.stack(ref_logps, 1).numpy().astype(np.float32),
        **{f"metric/{name}": np.float32(metrics[name]) for name in wanted},
        **grads,
    )
    size = sum(p.stat().st_size for p in OUT.rglob("*") if p.is_file())
    print(f"loss {loss.item():.8f}; metrics {metrics}")
    print(f"wrote {sorted(p.name for p in OUT.iterdir())} ({size} bytes) to {OUT}")


if __name__ == "__main__":
    record()
