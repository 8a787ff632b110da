"""DPO step throughput against TRL's DPOTrainer, and the held-out accuracy of a learning check.

Throughput. One model config and one batch of preference pairs feed both sides:

* dew_pipe: ``Trainer(DPOObjective(...), clip_by_global_norm(1) + adam).fit`` on a
  ``PreferencePairs`` dataset, resumed round after round from the returned state, so each
  measured step is the library's whole step: host batch, checks, transfer, the compiled
  update (policy forward and backward over the ``2B`` rows, reference forward).
* TRL 1.16 (a subprocess in the reference environment, ``--trl-worker``): ``DPOTrainer``
  built on the same weights (saved with ``Pretrained.save``, loaded with ``from_pretrained``)
  for policy and reference, and per step what ``Trainer.train`` runs for one batch:
  ``training_step`` (TRL's ``compute_loss`` and backward), gradient clipping to norm 1,
  ``optimizer.step`` and ``zero_grad``, with the optimizer TRL creates (AdamW, weight
  decay 0; the learning-rate schedule is not stepped, so both sides run Adam at a constant
  rate).

Both sides start from the same weights and see the same batch every step, so their losses
must agree step for step (to float32 rounding); the report prints each side's mean loss over
the last round as a cross-check that both did the same work.

The two sides alternate rounds of ``--steps`` steps (each side idles while the other runs),
after warm-up steps that include compilation; pairs/s are medians over the rounds. Both use
float32 on the CPU with ``--threads`` intra-op threads.

Learning check. ``--learn-steps`` DPO steps from scratch on the generated digit-sorting task
(``dew_pipe.data.synthetic``), then the held-out preference accuracy: the share of unseen
pairs whose chosen reward ``beta * (log pi - log ref)`` strictly beats the rejected one.

Run from the repository root (the TRL side's interpreter: ``--reference-python``, else
``$DEW_PIPE_REFERENCE_PYTHON``, else ``.reference-venv/bin/python``, which
``benchmarks/reference_env.sh`` builds; see ``benchmarks/reference.py``)::

    .venv/bin/python benchmarks/dpo_step.py            # both parts
    .venv/bin/python benchmarks/dpo_step.py --learn-steps 0   # throughput only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from machine import print_machine
from reference import add_reference_argument, reference_python

CONFIG = dict(
    vocab_size=4096,
    emb_features=256,
    num_layers=4,
    num_heads=8,
    num_kv_heads=4,
    mlp_features=704,
    max_seq_len=256,
)
BETA, LR = 0.1, 1e-5


def make_pairs(pairs: int, width: int, vocab: int, seed: int = 0) -> list[dict]:
    """Random pairs: a shared prompt of 32-128 ids and two answers, the longest filling ``width``."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(pairs):
        prompt = int(rng.integers(32, 129))
        lengths = rng.integers(16, width - prompt + 1, 2)
        if i == 0:
            lengths[0] = width - prompt
        ids = rng.integers(3, vocab, prompt).tolist()
        row = {}
        for side, n in zip(("chosen", "rejected"), lengths, strict=True):
            row[side] = ids + rng.integers(3, vocab, int(n)).tolist()
            row[f"{side}_mask"] = [0] * prompt + [1] * int(n)
        rows.append(row)
    return rows


# ---------------------------------------------------------------- the TRL side


def trl_worker(args: argparse.Namespace) -> None:
    """Runs in the reference environment: answers ``run N`` on stdin with the seconds N steps took."""
    import torch
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast
    from trl import DPOConfig, DPOTrainer

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )
    policy = LlamaForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    reference = LlamaForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    rows = [json.loads(line) for line in Path(args.pairs).read_text().splitlines()]
    with tempfile.TemporaryDirectory() as tmp:
        config = DPOConfig(
            output_dir=tmp,
            use_cpu=True,
            bf16=False,
            beta=BETA,
            learning_rate=args.lr,
            loss_type=["sigmoid"],
            report_to=[],
            max_length=None,
            max_grad_norm=1.0,
        )
        text = [{"prompt": "<pad>", "chosen": " </s>", "rejected": " </s>"}]
        trainer = DPOTrainer(
            model=policy,
            ref_model=reference,
            args=config,
            train_dataset=Dataset.from_list(text),
            processing_class=tokenizer,
        )
    width = max(len(row[side]) for row in rows for side in ("chosen", "rejected"))
    sides = [(row["chosen"], row["chosen_mask"]) for row in rows]
    sides += [(row["rejected"], row["rejected_mask"]) for row in rows]
    ids = torch.zeros((len(sides), width), dtype=torch.long)
    attention = torch.zeros_like(ids)
    completion = torch.zeros_like(ids)
    for r, (tokens, mask) in enumerate(sides):
        ids[r, : len(tokens)] = torch.tensor(tokens)
        attention[r, : len(tokens)] = 1
        completion[r, : len(tokens)] = torch.tensor(mask)
    batch = {"input_ids": ids, "attention_mask": attention, "completion_mask": completion}
    model = trainer.model
    model.train()
    trainer.create_optimizer()
    optimizer = trainer.optimizer
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train's loop otherwise

    def step() -> float:
        loss = trainer.training_step(model, batch)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        model.zero_grad(set_to_none=True)
        return float(loss)

    print(json.dumps({"ready": True, "torch": torch.__version__}), flush=True)
    for line in sys.stdin:
        command, _, count = line.strip().partition(" ")
        if command == "quit":
            return
        start = time.perf_counter()
        losses = [step() for _ in range(int(count))]
        seconds = time.perf_counter() - start
        print(json.dumps({"seconds": seconds, "loss": statistics.mean(losses)}), flush=True)


class TRLSide:
    """The TRL worker process, driven over a pipe."""

    def __init__(self, python: str, model: Path, pairs: Path, threads: int, lr: float = LR) -> None:
        command = [python, __file__, "--trl-worker", "--model", str(model)]
        command += ["--pairs", str(pairs), "--threads", str(threads), "--lr", repr(lr)]
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", TQDM_DISABLE="1")
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        self.info = self._reply()

    def _reply(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the TRL worker exited with code {self.process.wait()}")
        return json.loads(line)

    def run(self, steps: int) -> dict:
        self.process.stdin.write(f"run {steps}\n")
        self.process.stdin.flush()
        return self._reply()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.write("quit\n")
            self.process.stdin.flush()
            self.process.wait(timeout=60)


# ---------------------------------------------------------------- the dew_pipe side


def tree_bytes(tree) -> int:
    import jax

    return int(sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree)))


def matmul_peak(size: int = 2048, repeats: int = 5) -> float:
    """This machine's float32 matmul rate in FLOP/s, best of ``repeats`` (JAX, all threads)."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (size, size), jnp.float32)
    dot = jax.jit(jnp.dot)
    dot(a, a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dot(a, a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def step_flops(objective, state, batch) -> float:
    """XLA's FLOP count of one loss-and-gradient evaluation (the optimizer adds little)."""
    import jax

    grad = jax.jit(jax.value_and_grad(objective.loss, has_aux=True))
    compiled = grad.lower(state.params, batch, state.rng, state.ema).compile()
    analysis = compiled.cost_analysis()
    if isinstance(analysis, list):  # older JAX: one entry per computation
        analysis = analysis[0]
    return float(analysis["flops"])


def throughput(args: argparse.Namespace, work: Path) -> dict:
    import jax
    import optax

    from dew_pipe import Trainer, models
    from dew_pipe.data import PreferencePairs
    from dew_pipe.models import Pretrained
    from dew_pipe.objectives.rl import DPOObjective

    width = CONFIG["max_seq_len"]
    rows = make_pairs(args.pairs, width, CONFIG["vocab_size"])
    pairs_file = work / "pairs.jsonl"
    pairs_file.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    model = models.build("causal_transformer", **CONFIG)
    objective = DPOObjective(model, seq_len=width - 1, beta=BETA)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(LR))
    records: list[dict] = []
    trainer = Trainer(
        objective, optimizer, key=jax.random.key(0), progress=False, log=records.append
    )
    state = trainer.initial_state()
    Pretrained.from_model(model, state.params).save(state.params, work / "model")
    data = PreferencePairs(path=pairs_file, seq_len=width, shuffle=False).load(batch=args.pairs)
    flops = step_flops(objective, state, next(data.train((0, 1))))
    memory = {
        "policy_mib": tree_bytes(state.params) / 2**20,
        "reference_mib": tree_bytes(state.ema) / 2**20,
        "optimizer_mib": tree_bytes(state.opt_state) / 2**20,
    }
    trl = TRLSide(args.reference_python, work / "model", pairs_file, args.threads)
    ours, theirs, losses = [], [], {}
    try:
        state = trainer.fit(data, steps=args.warmup, log_every=10**6, state=state)
        trl.run(args.warmup)
        for _ in range(args.rounds):
            start = time.perf_counter()
            target = int(state.step) + args.steps
            state = trainer.fit(data, steps=target, log_every=10**6, state=state)
            jax.block_until_ready(state.params)
            ours.append(time.perf_counter() - start)
            reply = trl.run(args.steps)
            theirs.append(reply["seconds"])
            losses["trl"] = reply["loss"]
    finally:
        trl.close()
    # Both: the mean loss of the last round's steps (the Trainer's log record averages them).
    losses["dew_pipe"] = [r["loss"] for r in records if "loss" in r][-1]
    ours_rate = args.pairs * args.steps / statistics.median(ours)
    trl_rate = args.pairs * args.steps / statistics.median(theirs)
    peak = matmul_peak()
    per_s = {
        name: flops * rate / args.pairs
        for name, rate in (("dew_pipe", ours_rate), ("trl", trl_rate))
    }
    return {
        "pairs_per_s": {"dew_pipe": ours_rate, "trl": trl_rate},
        "step_gflop": flops / 1e9,
        "achieved_gflop_per_s": {name: value / 1e9 for name, value in per_s.items()},
        "matmul_peak_gflop_per_s": peak / 1e9,
        "share_of_peak": {name: value / peak for name, value in per_s.items()},
        "ratio": ours_rate / trl_rate,
        "round_seconds": {"dew_pipe": ours, "trl": theirs},
        "loss_after": losses,
        "memory": memory,
        "torch": trl.info.get("torch"),
        "jax": jax.__version__,
    }


def learning(args: argparse.Namespace) -> dict:
    import jax
    import jax.numpy as jnp
    import optax

    from dew_pipe import Trainer, models
    from dew_pipe.data import PreferencePairs
    from dew_pipe.data.synthetic import VOCAB, digit_preferences
    from dew_pipe.objectives.rl import DPOObjective

    width = 14
    train = tuple(json.dumps(r) for r in digit_preferences(4096, max_digits=6, seed=0))
    held = tuple(json.dumps(r) for r in digit_preferences(2048, max_digits=6, seed=1))
    pairs = PreferencePairs(records=train, seq_len=width, val_records=held)
    data = pairs.load(batch=32)
    model = models.build(
        "causal_transformer",
        vocab_size=VOCAB,
        emb_features=64,
        num_layers=2,
        num_heads=4,
        mlp_features=128,
        max_seq_len=width,
    )
    objective = DPOObjective(model, seq_len=width - 1, beta=0.5)
    trainer = Trainer(objective, optax.adam(3e-3), key=jax.random.key(0), progress=False)
    start = trainer.initial_state()
    before = trainer.evaluate(start, data)["perplexity"]
    state = trainer.fit(data, steps=args.learn_steps, log_every=10**6)
    chosen, rejected = jax.jit(objective.rewards)(state.params, state.ema, pairs.pairs("val"))
    return {
        "steps": args.learn_steps,
        "held_out_pairs": len(held),
        "held_out_accuracy": float(jnp.mean(chosen > rejected)),
        "chosen_perplexity": {
            "before": before,
            "after": trainer.evaluate(state, data)["perplexity"],
        },
    }


def main() -> None:
    if "--trl-worker" in sys.argv:
        worker = argparse.ArgumentParser()
        worker.add_argument("--trl-worker", action="store_true")
        worker.add_argument("--model", required=True)
        worker.add_argument("--pairs", required=True)
        worker.add_argument("--threads", type=int, default=2)
        worker.add_argument("--lr", type=float, default=LR)
        trl_worker(worker.parse_args())
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--pairs", type=int, default=8, help="pairs per batch")
    parser.add_argument("--steps", type=int, default=3, help="steps per measured round")
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds per side")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured steps per side")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--learn-steps", type=int, default=300, help="0 skips the learning check")
    add_reference_argument(parser)
    args = parser.parse_args()
    args.reference_python = reference_python(args.reference_python)
    report: dict = {"config": CONFIG, "pairs": args.pairs, "beta": BETA, "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory() as tmp:
        report["throughput"] = throughput(args, Path(tmp))
    rates = report["throughput"]["pairs_per_s"]
    print(
        f"DPO step, {args.pairs} pairs x {CONFIG['max_seq_len']} ids: dew_pipe "
        f"{rates['dew_pipe']:.2f} pairs/s, TRL {rates['trl']:.2f} pairs/s, ratio "
        f"{report['throughput']['ratio']:.2f}x (goal >= 1.5x)"
    )
    if args.learn_steps:
        report["learning"] = learning(args)
        print(
            f"learning check: held-out preference accuracy "
            f"{report['learning']['held_out_accuracy']:.4f} after {args.learn_steps} steps"
        )
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    print_machine()
    main()
