"""SFT step throughput against transformers + PyTorch (eager and ``torch.compile``).

One Llama-style config, one set of weights and one batch feed every side:

* dew_pipe: ``Trainer(LMObjective(model, seq_len=L, ema_decay=None), optax.adamw(...)).fit``
  on a ``Dataset`` that repeats the batch, resumed round after round from the returned
  state, so a measured step is the library's whole step (host batch, checks, transfer, the
  compiled update: forward, backward, AdamW).
* PyTorch (subprocesses in the reference environment): ``LlamaForCausalLM`` loaded with
  ``from_pretrained`` from the weights dew_pipe saved with ``Pretrained.save``, SDPA
  attention, ``torch.optim.AdamW`` with the same hyperparameters; a step is forward, the
  same next-token cross-entropy (mean over the ``B * L`` targets), backward,
  ``optimizer.step`` and ``zero_grad``. ``eager`` runs it as is; ``compile`` wraps the
  loss function (model and cross-entropy) in ``torch.compile`` (the optimizer stays the
  default foreach AdamW).

Every side runs in its own process with ``--threads`` intra-op threads (dew_pipe: XLA's CPU
client uses the machine's cores; run this on a machine with exactly that many). The sides
alternate rounds of ``--steps`` steps, so a change in machine load hits all of them; the
order rotates every round. Reported per side: the median over ``--rounds`` rounds of the
wall-clock time per step, tokens/s, the CPU time per step (user + system, both threads:
less sensitive to other processes on a shared machine), and every round's mean loss (all
sides start from the same weights and see the same batch every step, so their losses agree
round for round up to float32 rounding: a check that every side did the same work).

FLOPs per step (model FLOPs, the same count for every side, as in the PaLM paper's MFU):
``6 * N * T + 12 * layers * heads * head_dim * S * T`` with ``N`` the parameters that take
part in matmuls (every projection and the LM head; not the embedding lookup or norms) and
``T = B * S`` tokens; the attention term counts the full ``S x S`` score and value
matmuls, forward and backward, without discounting the causal mask. The machine's matmul
rate is measured after every round, under that round's conditions: a ``2048 x 2048``
float32 matmul in JAX and in PyTorch (best of 10 each), the faster of the two. "share of
peak" divides a side's achieved FLOP/s (median over rounds) by the median of those rates.
On a shared machine the medians mix quiet and contended rounds; the report also gives each
side's best round, and its share of the best matmul rate ("best/best").

dew_pipe runs with its default host memory policy (``dew_pipe.host_memory``: freed memory is
kept for reuse); ``--host-memory system`` runs it with glibc's defaults instead
(``DEW_PIPE_HOST_MEMORY=system``) and ``--host-memory both`` adds that as one more side.
PyTorch runs with the environment as given.

Run from the repository root::

    .venv/bin/python benchmarks/train_step.py [--reference-python PATH]

The PyTorch interpreter comes from ``--reference-python``, else ``DEW_PIPE_REFERENCE_PYTHON``,
else ``.reference-venv/bin/python``; ``benchmarks/reference_env.sh`` builds that environment
(torch and transformers; ``benchmarks/reference.py`` says how it is found).
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
LR, WEIGHT_DECAY = 1e-4, 0.01
MATMUL = 2048


def model_flops(config: dict, batch: int, length: int) -> tuple[float, int]:
    """``(FLOPs per training step, matmul parameter count)`` by the formula in the docstring."""
    d, f, v = config["emb_features"], config["mlp_features"], config["vocab_size"]
    heads, kv = config["num_heads"], config.get("num_kv_heads") or config["num_heads"]
    head_dim = config.get("head_dim") or d // heads
    per_layer = d * heads * head_dim + 2 * d * kv * head_dim + heads * head_dim * d + 3 * d * f
    params = config["num_layers"] * per_layer + d * v
    tokens = batch * length
    attention = 12 * config["num_layers"] * heads * head_dim * length * tokens
    return 6.0 * params * tokens + attention, params


def make_batch(batch: int, length: int, vocab: int, seed: int = 0) -> np.ndarray:
    """``[batch, length + 1]`` random token ids (every target counts)."""
    return np.random.default_rng(seed).integers(0, vocab, (batch, length + 1)).astype(np.int32)


def _timed(fn, count: int) -> dict:
    cpu, wall = time.process_time(), time.perf_counter()
    loss = fn(count)
    return {
        "seconds": time.perf_counter() - wall,
        "cpu_seconds": time.process_time() - cpu,
        "loss": loss,
    }


def _serve(ready: dict, run, peak) -> None:
    """Answers ``run N`` and ``peak`` on stdin with one JSON line each; ``quit`` ends."""
    print(json.dumps(ready), flush=True)
    for line in sys.stdin:
        command, _, count = line.strip().partition(" ")
        if command == "quit":
            return
        if command == "peak":
            print(json.dumps({"matmul_flops": peak()}), flush=True)
            continue
        print(json.dumps(_timed(run, int(count))), flush=True)


# ---------------------------------------------------------------- PyTorch worker


def torch_worker(args: argparse.Namespace) -> None:
    """Runs in the reference environment: eager or compiled transformers Llama + AdamW."""
    import torch
    import torch.nn.functional as F
    from transformers import LlamaForCausalLM

    torch.set_num_threads(args.threads)
    model = LlamaForCausalLM.from_pretrained(
        args.model, dtype=torch.float32, attn_implementation="sdpa"
    )
    model.train()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=WEIGHT_DECAY
    )
    text = torch.from_numpy(np.load(args.batch_file)).long()
    inputs, targets = text[:, :-1].contiguous(), text[:, 1:].reshape(-1).contiguous()

    def loss_fn(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # bfloat16: PyTorch's mixed precision on the CPU (float32 weights and optimizer,
        # matmuls in bfloat16 under autocast), as dew_pipe's dtype=bfloat16.
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bfloat16"):
            logits = model(input_ids=ids, use_cache=False).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels)

    if args.torch_mode == "compile":
        loss_fn = torch.compile(loss_fn)

    def run(count: int) -> float:
        losses = []
        for _ in range(count):
            loss = loss_fn(inputs, targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
        return statistics.mean(losses)

    peak = matmul_rate_torch(args.threads)
    ready = {"ready": True, "torch": torch.__version__, "matmul_flops": peak}
    _serve(ready, run, lambda: matmul_rate_torch(args.threads))


def matmul_rate_torch(threads: int, repeats: int = 10) -> float:
    import torch

    torch.set_num_threads(threads)
    a = torch.randn(MATMUL, MATMUL)
    out = torch.empty_like(a)
    torch.mm(a, a, out=out)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, a, out=out)
        best = min(best, time.perf_counter() - start)
    return 2 * MATMUL**3 / best


# ---------------------------------------------------------------- dew_pipe worker


def matmul_rate_jax(repeats: int = 10) -> float:
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (MATMUL, MATMUL), jnp.float32)
    dot = jax.jit(jnp.dot)
    dot(a, a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dot(a, a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * MATMUL**3 / best


def dew_worker(args: argparse.Namespace) -> None:
    """Runs dew_pipe's Trainer on the batch; saves the initial weights for PyTorch."""
    import itertools

    import jax
    import optax

    from dew_pipe import Dataset, LMObjective, Trainer, host_memory, models
    from dew_pipe.models import Pretrained

    config = dict(CONFIG, **json.loads(args.model_options))
    model = models.build("causal_transformer", **config, dtype=args.precision)
    text = np.load(args.batch_file)
    length = text.shape[1] - 1
    objective = LMObjective(model, seq_len=length, ema_decay=None)
    optimizer = optax.adamw(LR, b1=0.9, b2=0.999, eps=1e-8, weight_decay=WEIGHT_DECAY)
    records: list[dict] = []
    trainer = Trainer(
        objective, optimizer, key=jax.random.key(0), progress=False, log=records.append
    )
    state = trainer.initial_state()
    if args.save:
        Pretrained.from_model(model, state.params).save(state.params, args.save)
    data = Dataset(
        train=lambda partition: itertools.repeat({"text": text}),
        val=None,
        records=None,
        batch=text.shape[0],
    )
    holder = {"state": state}

    def run(count: int) -> float:
        state = holder["state"]
        # One log record at the end of the call (fit opens a new log per call): the mean
        # loss of exactly these steps, and no extra host sync in between.
        state = trainer.fit(data, steps=int(state.step) + count, log_every=10**9, state=state)
        jax.block_until_ready(state.params)
        holder["state"] = state
        return float(records[-1]["loss"])  # the mean over this call's steps

    peak = matmul_rate_jax()
    ready = {"ready": True, "jax": jax.__version__, "matmul_flops": peak, "config": config}
    _serve(dict(ready, host_memory=host_memory.status()), run, matmul_rate_jax)


# ---------------------------------------------------------------- driver


class Side:
    """One worker process, driven over a pipe."""

    def __init__(self, name: str, command: list[str], env: dict) -> None:
        self.name = name
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        self.info = self._reply()
        self.rounds: list[dict] = []

    def _reply(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.name} worker exited with code {self.process.wait()}")
        return json.loads(line)

    def run(self, steps: int) -> dict:
        self.process.stdin.write(f"run {steps}\n")
        self.process.stdin.flush()
        return self._reply()

    def peak(self) -> float:
        self.process.stdin.write("peak\n")
        self.process.stdin.flush()
        return self._reply()["matmul_flops"]

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.write("quit\n")
            self.process.stdin.flush()
            self.process.wait(timeout=120)


def _sides(args: argparse.Namespace, work: Path, python: str) -> list[Side]:
    script = str(Path(__file__).resolve())
    common = ["--batch-file", str(work / "batch.npy"), "--threads", str(args.threads)]
    common += ["--precision", args.precision]
    dew = [sys.executable, script, "--worker", "dew", "--model-options", args.model_options]
    sides = []
    policies = ["reuse", "system"] if args.host_memory == "both" else [args.host_memory]
    for index, policy in enumerate(policies):
        save = ["--save", str(work / "model")] if index == 0 else []
        name = "dew_pipe" if index == 0 else f"dew_pipe[{policy}]"
        env = dict(os.environ, DEW_PIPE_HOST_MEMORY=policy)
        sides.append(Side(name, dew + common + save, env))
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    for mode in args.torch:
        command = [python, script, "--worker", "torch", "--torch-mode", mode]
        command += ["--model", str(work / "model")] + common
        sides.append(Side(f"torch_{mode}", command, env))
    return sides


def measure(args: argparse.Namespace, python: str) -> dict:
    config = dict(CONFIG, **json.loads(args.model_options))
    flops, params = model_flops(config, args.batch, args.seq_len)
    tokens = args.batch * args.seq_len
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        np.save(work / "batch.npy", make_batch(args.batch, args.seq_len, config["vocab_size"]))
        sides = _sides(args, work, python)
        try:
            for side in sides:
                side.run(args.warmup)
            peaks: dict[str, list[float]] = {"jax": [], "torch": []}
            for round_index in range(args.rounds):
                shift = round_index % len(sides)
                for side in sides[shift:] + sides[:shift]:
                    side.rounds.append(side.run(args.steps))
                # The matmul rate under this round's conditions, from both libraries.
                peaks["jax"].append(sides[0].peak())
                if len(sides) > 1 and "torch" in sides[-1].info:
                    peaks["torch"].append(sides[-1].peak())
        finally:
            for side in sides:
                side.close()
    # The machine's rate: per round the faster library's best-of-10 2048^2 matmul; the
    # median over rounds (the same conditions as the step medians) and the best round.
    per_round = [max(values) for values in zip(*(v for v in peaks.values() if v), strict=True)]
    peak, best_peak = statistics.median(per_round), max(per_round)
    report = {
        "config": config,
        "precision": args.precision,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "tokens_per_step": tokens,
        "matmul_params": params,
        "step_gflop": flops / 1e9,
        "matmul_peak_gflop_per_s": peak / 1e9,
        "matmul_best_gflop_per_s": best_peak / 1e9,
        "matmul_rounds_gflop_per_s": {
            name: [v / 1e9 for v in values] for name, values in peaks.items() if values
        },
        "versions": {s.name: s.info.get("torch") or s.info.get("jax") for s in sides},
        "host_memory": {s.name: s.info["host_memory"] for s in sides if "host_memory" in s.info},
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "sides": {},
    }
    for side in sides:
        step = statistics.median(r["seconds"] for r in side.rounds) / args.steps
        best = min(r["seconds"] for r in side.rounds) / args.steps
        cpu = statistics.median(r["cpu_seconds"] for r in side.rounds) / args.steps
        report["sides"][side.name] = {
            "ms_per_step": step * 1e3,
            "best_round_ms_per_step": best * 1e3,
            "cpu_ms_per_step": cpu * 1e3,
            "tokens_per_s": tokens / step,
            "best_round_tokens_per_s": tokens / best,
            "achieved_gflop_per_s": flops / step / 1e9,
            "share_of_peak": flops / step / peak,
            "best_round_share_of_best_peak": flops / best / best_peak,
            "round_ms_per_step": [r["seconds"] / args.steps * 1e3 for r in side.rounds],
            "round_losses": [r["loss"] for r in side.rounds],
        }
    ours = report["sides"][sides[0].name]
    report["ratios"] = {
        f"{sides[0].name}/{name}": ours["tokens_per_s"] / values["tokens_per_s"]
        for name, values in report["sides"].items()
        if name != sides[0].name
    }
    report["best_round_ratios"] = {
        f"{sides[0].name}/{name}": ours["best_round_tokens_per_s"]
        / values["best_round_tokens_per_s"]
        for name, values in report["sides"].items()
        if name != sides[0].name
    }
    return report


def _print(report: dict) -> None:
    print(
        f"SFT step ({report['precision']} compute), batch {report['batch']} x {report['seq_len']}, "
        f"{report['step_gflop']:.1f} GFLOP/step, matmul peak median "
        f"{report['matmul_peak_gflop_per_s']:.0f} GFLOP/s, best "
        f"{report['matmul_best_gflop_per_s']:.0f} GFLOP/s"
    )
    head = ("side", "ms/step", "cpu ms", "tokens/s", "GFLOP/s", "peak", "best ms", "best/best")
    print("{:22s} {:>8s} {:>8s} {:>9s} {:>8s} {:>6s} {:>8s} {:>9s}".format(*head))
    for name, side in report["sides"].items():
        print(
            f"{name:22s} {side['ms_per_step']:8.1f} {side['cpu_ms_per_step']:8.1f} "
            f"{side['tokens_per_s']:9.0f} {side['achieved_gflop_per_s']:8.1f} "
            f"{side['share_of_peak']:6.1%} {side['best_round_ms_per_step']:8.1f} "
            f"{side['best_round_share_of_best_peak']:9.1%}"
        )
    for name, ratio in report["ratios"].items():
        best = report["best_round_ratios"][name]
        print(f"tokens/s ratio {name}: {ratio:.2f}x (medians), {best:.2f}x (best rounds)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    add_reference_argument(parser)
    parser.add_argument("--batch", type=int, default=8, help="rows per step")
    parser.add_argument("--seq-len", type=int, default=256, help="predicted tokens per row")
    parser.add_argument("--steps", type=int, default=3, help="steps per measured round")
    parser.add_argument("--rounds", type=int, default=7, help="measured rounds per side")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured steps per side")
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads (PyTorch)")
    parser.add_argument(
        "--torch", nargs="*", default=["eager", "compile"], choices=["eager", "compile"]
    )
    parser.add_argument(
        "--model-options", default="{}", help="JSON of extra causal_transformer options"
    )
    parser.add_argument(
        "--host-memory",
        choices=["reuse", "system", "both"],
        default="reuse",
        help="dew_pipe's host memory policy (DEW_PIPE_HOST_MEMORY); both: two sides",
    )
    parser.add_argument(
        "--precision",
        choices=["float32", "bfloat16"],
        default="float32",
        help="compute precision of every side (weights and AdamW stay float32): bfloat16 "
        "is dew_pipe's dtype=bfloat16 and PyTorch's CPU autocast; the matmul rate (the "
        "share of peak) stays float32's",
    )
    parser.add_argument("--json", type=Path, help="also write the report here")
    # worker-only arguments
    parser.add_argument("--worker", choices=["dew", "torch"], help=argparse.SUPPRESS)
    parser.add_argument("--torch-mode", choices=["eager", "compile"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--batch-file", help=argparse.SUPPRESS)
    parser.add_argument("--save", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "torch":
        torch_worker(args)
        return
    if args.worker == "dew":
        dew_worker(args)
        return
    report = measure(args, reference_python(args.reference_python))
    _print(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    print_machine()
    main()
