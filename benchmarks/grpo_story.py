"""The spec's GRPO example on the small story decoder: how far it moves the dog share.

The spec's run (a TinyStories decoder, ``adamw(1e-4)``, 20 steps, 8 prompts x 4 samples of
8 tokens) took the share of sampled completions that mention a dog from 3/128 to 128/128.
This script runs the same example, verbatim but for the learning rate and step count, on
the decoder the tests train (``tests/story_prelude.py``), and counts dog mentions among
128 completions (temperature 1, top-k 40) before and after, with the same draws on both
sides. It also runs a narrower decoder (width 64) to show how the response to a fixed
learning rate depends on width: Adam moves every weight by about the learning rate per
step, and a logit is a sum over more of them in a wider model.

Usage::

    .venv/bin/python benchmarks/grpo_story.py            # the table in RESULTS.md
    .venv/bin/python benchmarks/grpo_story.py --seeds 1 --widths 128 --runs 1e-4:20

Each row prints before/after counts per seed, the mean reward of the last GRPO step, and
the seconds per GRPO step after the first (rollout of 32 completions + update).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from machine import print_machine
from story_prelude import story_decoder  # noqa: E402

from dew_pipe import Dataset, Sampling, Trainer  # noqa: E402
from dew_pipe.data.stories import DOG_PROMPT, story_tokenizer  # noqa: E402
from dew_pipe.inference import generate  # noqa: E402
from dew_pipe.objectives.rl import GRPOObjective, SampledRollout  # noqa: E402


def dog_count(model, params, prompt, tokenizer, key) -> int:
    """Completions out of 128 (temperature 1, top-k 40, 8 ids) whose text contains "dog"."""
    rows = np.tile(np.array(prompt, np.int32), (128, 1))
    out = generate(
        model, params, rows, np.full(128, len(prompt), np.int32), 8, key,
        Sampling(temperature=1.0, top_k=40),
    )  # fmt: skip
    return sum("dog" in tokenizer.decode(ids.tolist()) for ids in np.asarray(out.ids))


def prompt_batch(prompt: list[int]) -> dict[str, np.ndarray]:
    """The example's hand-built batch of 8 identical prompts."""
    return {
        "prompt": np.tile(np.array(prompt, dtype=np.int32), (8, 1)),
        "prompt_length": np.full(8, len(prompt), dtype=np.int32),
        "data_source": np.tile(np.frombuffer(b"tinystories", np.uint8).astype(np.int32), (8, 1)),
        "ground_truth": np.tile(np.frombuffer(b"dog", np.uint8).astype(np.int32), (8, 1)),
        "extra_info": np.zeros((8, 0), dtype=np.int32),
    }


def reward(data_source: str, completion: str, ground_truth: str, extra_info: str) -> float:
    return float(ground_truth in completion)


def grpo(decoder, prompt, learning_rate: float, steps: int, seed: int) -> dict[str, float]:
    """One run of the example; returns counts, last reward mean and seconds per step."""
    model, lm_state, tokenizer = decoder
    batch = prompt_batch(prompt)
    data = Dataset(train=lambda partition: itertools.repeat(batch), val=None, records=8, batch=8)
    objective = GRPOObjective(model, seq_len=len(prompt) + 7, beta=0.01, pretrained=lm_state.params)
    rollout = SampledRollout(
        objective,
        reward=reward,
        groups=4,
        max_new_tokens=8,
        sampling=Sampling(temperature=1.0, top_k=40),
        decode=tokenizer.decode,
    )
    records = []
    trainer = Trainer(
        objective, optax.adamw(learning_rate), key=jax.random.key(3 + seed), rollout=rollout,
        log=records.append, progress=False,
    )  # fmt: skip
    state = trainer.fit(data, steps=1, log_every=1)  # compiles
    start = time.perf_counter()
    state = trainer.fit(data, steps=steps, log_every=1, state=state)
    per_step = (time.perf_counter() - start) / max(steps - 1, 1)
    key = jax.random.key(100 + seed)
    return {
        "before": dog_count(model, lm_state.params, prompt, tokenizer, key),
        "after": dog_count(model, state.params, prompt, tokenizer, key),
        "last_reward": records[-1]["rollout/reward/mean"],
        "seconds": per_step,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[128, 64])
    parser.add_argument(
        "--runs",
        nargs="+",
        default=["1e-4:20", "3e-4:20", "1e-3:20", "1e-4:60"],
        help="learning rate:GRPO steps pairs",
    )
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    tokenizer = story_tokenizer()
    prompt = tokenizer.encode(DOG_PROMPT)
    print("| decoder width | adamw lr | GRPO steps | dog mentions before -> after (of 128), per seed"
          " | mean after | last step's mean reward | s per GRPO step |")  # fmt: skip
    print("|---:|---:|---:|---|---:|---:|---:|")
    for width in args.widths:
        started = time.perf_counter()
        decoder = story_decoder(
            tokenizer, config={"emb_features": width, "mlp_features": 4 * width}
        )
        print(f"<!-- prelude, width {width}: {time.perf_counter() - started:.1f} s -->", flush=True)
        for run in args.runs:
            lr, steps = float(run.split(":")[0]), int(run.split(":")[1])
            runs = [grpo(decoder, prompt, lr, steps, seed) for seed in range(args.seeds)]
            pairs = ", ".join(f"{r['before']} -> {r['after']}" for r in runs)
            mean_after = statistics.mean(r["after"] for r in runs)
            reward_mean = statistics.mean(r["last_reward"] for r in runs)
            seconds = statistics.median(r["seconds"] for r in runs)
            print(
                f"| {width} | {lr:g} | {steps} | {pairs} | {mean_after:.1f} | "
                f"{reward_mean:.2f} | {seconds:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    print_machine()
    main()
