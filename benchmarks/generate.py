"""Greedy generation tokens/s: dew_pipe's compiled generation against transformers `generate`.

Both sides run the same Llama-style model with the same weights: the script initialises
the decoder, writes it as a transformers checkpoint with `Pretrained.save`, loads it back
for JAX with `load_pretrained` (the HF import) and hands the directory to the torch side,
which loads it with ``LlamaForCausalLM.from_pretrained`` and calls ``generate`` with its
KV cache (greedy, no EOS, so every row runs the full budget on both sides).

The torch side runs in a separate interpreter (dew_pipe never imports torch): the Python of
the reference environment, found from ``--reference-python``, else the
``DEW_PIPE_REFERENCE_PYTHON`` environment variable, else ``.reference-venv/bin/python``, which
``benchmarks/reference_env.sh`` builds (``benchmarks/reference.py``). It stays up for the
whole run and times one ``generate`` call per request, so the two sides alternate round by
round on a machine shared with other work; each side reports the median of its rounds. Both
use float32.

Threads: XLA runs this model's decode step on one core (its CPU time equals its wall
time), and torch runs with one intra-op thread by default here (``--torch-threads``). On a
2-core machine that other jobs also load, torch's default two OpenMP threads spin at every
barrier while one of them waits to be scheduled: the same call then takes 0.2 s or 10 s
depending on the neighbours, which measures the machine rather than the library. Pass
``--torch-threads 0`` to time torch's default anyway.

Default sizes (issue 5): vocab 4096, hidden 256, 4 layers, 8 heads, 4 kv heads,
intermediate 704; batch 16, prompt 32, 64 new tokens. Goal: >= 3x transformers.

    .venv/bin/python benchmarks/generate.py [--rounds 15] [--reference-python PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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


def torch_worker(directory: str, threads: int) -> None:
    """Runs in the reference environment: loads the checkpoint, answers 'run' with a timing."""
    import numpy as np
    import torch
    import transformers

    if threads > 0:
        torch.set_num_threads(threads)
    model = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # no early stop: every row runs the budget
    model.generation_config.pad_token_id = 0
    spec = json.loads(Path(directory, "bench.json").read_text())
    prompts = torch.from_numpy(np.load(Path(directory, "prompts.npy")).astype(np.int64))
    mask = torch.ones_like(prompts)

    def run() -> tuple[float, list]:
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                prompts, attention_mask=mask, max_new_tokens=spec["new"], do_sample=False
            )
        return time.perf_counter() - start, out[:, prompts.shape[1] :].tolist()

    run()  # warm-up
    print(json.dumps({"ready": True, "threads": torch.get_num_threads()}), flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        seconds, ids = run()
        print(json.dumps({"seconds": seconds, "ids": ids}), flush=True)


class TorchSide:
    """The torch worker process, one timed generate per `run` call."""

    def __init__(self, python: str, directory: str, threads: int) -> None:
        self.process = subprocess.Popen(
            [python, __file__, "--torch-worker", directory, "--torch-threads", str(threads)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.info = self._read()

    def _read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"torch worker exited with status {self.process.wait()}")
        return json.loads(line)

    def run(self) -> dict:
        self.process.stdin.write("run\n")
        self.process.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait(timeout=60)


def report(args: argparse.Namespace, runs: dict) -> None:
    """Prints both sides' medians, the ratios and the agreement of the greedy ids."""

    mine, theirs, ids, torch_ids = runs["mine"], runs["theirs"], runs["ids"], runs["torch_ids"]
    tokens = args.batch * args.new
    ours_s, torch_s = statistics.median(mine), statistics.median(theirs)
    ratios = [t / m for m, t in zip(mine, theirs, strict=True)]
    print(f"batch {args.batch}, prompt {args.prompt}, {args.new} new tokens, greedy, float32, "
          f"{args.rounds} rounds; torch threads {runs['threads']}; jax {runs['devices']}")  # fmt: skip
    print(f"dew_pipe generate: median {ours_s * 1e3:7.1f} ms  {tokens / ours_s:8.0f} tokens/s")
    print(f"   (min {min(mine) * 1e3:.1f} ms; first call with compile {runs['compile_s']:.2f} s)")
    print(f"transformers:      median {torch_s * 1e3:7.1f} ms  {tokens / torch_s:8.0f} tokens/s")
    print(f"   (min {min(theirs) * 1e3:.1f} ms)")
    print(f"speed-up: {torch_s / ours_s:.2f}x of medians, {min(theirs) / min(mine):.2f}x of minima")
    print(
        f"per-round ratios (each side's call of the same round): median "
        f"{statistics.median(ratios):.2f}x, range {min(ratios):.2f}-{max(ratios):.2f}x"
    )
    same = float((ids == torch_ids).mean())
    print(
        f"same greedy ids as transformers: {same:.1%} (first id {(ids[:, 0] == torch_ids[:, 0]).mean():.1%})"
    )


def measure(args: argparse.Namespace, python: str) -> dict:
    """Builds the model, exports it for torch, and times alternating rounds of both sides."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dew_pipe import models
    from dew_pipe.inference import generate
    from dew_pipe.sampling import Sampling

    B, P, R = args.batch, args.prompt, args.new
    model = models.build("causal_transformer", **CONFIG)
    variables = model.init(jax.random.key(args.seed), jnp.zeros((1, 8), jnp.int32))
    rng = np.random.default_rng(args.seed)
    prompts = rng.integers(0, CONFIG["vocab_size"], (B, P)).astype(np.int32)
    lengths = np.full(B, P, np.int32)
    greedy = Sampling(temperature=0)
    with tempfile.TemporaryDirectory() as directory:
        exported = models.Pretrained.from_model(model, variables, architecture="LlamaForCausalLM")
        exported.save(variables, directory)
        np.save(Path(directory, "prompts.npy"), prompts)
        Path(directory, "bench.json").write_text(json.dumps({"new": R}))
        pretrained = models.load_pretrained(directory, max_seq_len=CONFIG["max_seq_len"])

        def ours() -> tuple[float, np.ndarray]:
            start = time.perf_counter()
            out = generate(
                pretrained.model, pretrained.variables, prompts, lengths, R,
                jax.random.key(0), greedy,
            )  # fmt: skip
            ids = np.asarray(out.ids)  # includes the device-to-host copy
            return time.perf_counter() - start, ids

        torch_side = TorchSide(python, directory, args.torch_threads)
        try:
            compile_s, _ = ours()
            runs = dict(mine=[], theirs=[], compile_s=compile_s)
            for _ in range(args.rounds):
                seconds, runs["ids"] = ours()
                runs["mine"].append(seconds)
                reply = torch_side.run()
                runs["theirs"].append(reply["seconds"])
            runs["torch_ids"] = np.asarray(reply["ids"])
        finally:
            torch_side.close()
    runs.update(threads=torch_side.info["threads"], devices=jax.devices())
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    add_reference_argument(parser)
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch intra-op threads (0: torch's default); see the module docstring",
    )
    parser.add_argument("--torch-worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.torch_worker:
        torch_worker(args.torch_worker, args.torch_threads)
        return
    report(args, measure(args, reference_python(args.reference_python)))


if __name__ == "__main__":
    print_machine()
    main()
