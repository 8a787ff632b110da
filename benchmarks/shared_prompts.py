"""The GRPO update on plain rows against the same batch packed with ``share_prompts=True``.

The asynchronous benchmark's shapes by default: B = 16 prompts of 24 to P = 64 ids, G = 8
completions of R = 24 ids each, the story decoder's size (852 ids, width 128, 2 blocks, MLP
512), ``GRPOObjective(behavior_importance=2.0, proximal_in_step=True)`` with the head on the
sampled ids (``response_columns``: R for a plain row, G * R for a shared one), AdamW. Plain
rows: B * G rows of P + R ids. Shared rows: B rows of P - 1 + G * (R + 1) ids, the
``seq_len`` rounded up to a multiple of 8. Made-up sessions (random ids and rewards), so no
model is trained first; the update's cost does not depend on the values.

Each side runs in its own process pinned to one core (``Trainer.train_step`` timed around
``block_until_ready``, ``--steps`` after 3 untimed), the sides alternate over ``--rounds``,
and the report gives each side's median, the ratio, and each side's loss and trained ids
(equal sides train the same ids to the same loss).

Command: ``.venv/bin/python benchmarks/shared_prompts.py [--rounds 3]``; with
``--sides shared,shared-bfloat16`` the shared rows' update in float32 against the same
update with the decoder multiplying in bfloat16 (float32 parameters and AdamW). The side
``shared-bfloat16-all-keys`` is ``shared-bfloat16`` with the last block's column queries
reading every key, as before ``features(increasing_columns=True)`` (this process drops the
flag the objective passes), for the record of what that promise saves.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import print_machine  # noqa: E402

SIDES = ("plain", "shared")
# shared rows, the update multiplying in bfloat16; the same without increasing_columns
EXTRA = ("shared-bfloat16", "shared-bfloat16-all-keys")


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="timed updates per side and round")
    parser.add_argument("--prompts", type=int, default=16, help="B")
    parser.add_argument("--groups", type=int, default=8, help="G")
    parser.add_argument("--prompt-len", type=int, default=64, help="P, the longest prompt")
    parser.add_argument("--new-tokens", type=int, default=24, help="R")
    parser.add_argument(
        "--sides",
        default=",".join(SIDES),
        help=f"sides to alternate, among {SIDES + EXTRA}: shared-bfloat16 is the shared "
        "rows with the decoder's dtype=bfloat16 (float32 parameters and AdamW); "
        "shared-bfloat16-all-keys the same with every key read by the last block's columns",
    )
    parser.add_argument("--side", choices=SIDES + EXTRA, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.sides = tuple(name for name in args.sides.split(",") if name)
    unknown = sorted(set(args.sides) - set(SIDES + EXTRA))
    if unknown or len(args.sides) < 2:
        parser.error(f"--sides is {args.sides}; expected two or more of {SIDES + EXTRA}")
    return args


def shape(args: argparse.Namespace, shared: bool) -> tuple[int, int, int]:
    """Row width, rows and response columns of one side."""
    if not shared:
        return args.prompt_len + args.new_tokens, args.prompts * args.groups, args.new_tokens
    seq_len = args.prompt_len - 2 + args.groups * (args.new_tokens + 1)
    return -(-seq_len // 8) * 8 + 1, args.prompts, args.groups * args.new_tokens


def all_keys() -> None:
    """Make this process's decoder ignore ``increasing_columns``: the last block's column
    queries then read every key, the computation before that promise."""
    from dew_pipe.models.transformer import CausalTransformer

    features = CausalTransformer.features

    def every_key(self, *args, increasing_columns: bool = False, **kwargs):
        return features(self, *args, **kwargs)

    CausalTransformer.features = every_key


def side(args: argparse.Namespace) -> dict:
    os.sched_setaffinity(0, {0})  # before JAX starts its threads
    import jax
    import numpy as np
    import optax

    from dew_pipe import Trainer, models
    from dew_pipe.objectives.rl import Call, GRPOObjective, Session, pack

    shared = args.side.startswith("shared")
    if args.side.endswith("all-keys"):
        all_keys()
    vocab = 852
    rng = np.random.default_rng(0)
    sessions = []
    for b in range(args.prompts):
        prompt = rng.integers(1, vocab, int(rng.integers(24, args.prompt_len + 1)))
        for g in range(args.groups):
            ids = rng.integers(1, vocab, args.new_tokens)
            behavior = -rng.uniform(0.1, 3.0, args.new_tokens)
            call = Call(prompt, ids, behavior, "length", 0)
            sessions.append(Session(b, 0, g, 0, [call], "TRUNCATED", float(rng.normal())))
    width, rows, columns = shape(args, shared)
    batch = pack(sessions, width, rows=rows, truncation="score", share_prompts=shared)
    model = models.build(
        "causal_transformer", vocab_size=vocab, emb_features=128, num_layers=2, num_heads=4,
        mlp_features=512, max_seq_len=width,
        dtype="bfloat16" if "bfloat16" in args.side else "float32",
    )  # fmt: skip
    objective = GRPOObjective(
        model, seq_len=width - 1, behavior_importance=2.0, proximal_in_step=True,
        response_columns=columns,
    )  # fmt: skip
    trainer = Trainer(objective, optax.adamw(1e-4), key=jax.random.key(0), progress=False)
    state = trainer.initial_state()
    for _ in range(3):
        state, metrics = trainer.train_step(state, batch)
        jax.block_until_ready(state)
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        state, metrics = trainer.train_step(state, batch)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - start)
    return {
        "side": args.side,
        "shape": [rows, width],
        "ms": 1e3 * statistics.median(times),
        "loss": float(metrics["loss"]),
        "tokens": float(metrics["tokens"]),
    }


def main() -> None:
    args = arguments()
    if args.side:
        print(json.dumps(side(args)))
        return
    print_machine()
    found: dict[str, list[dict]] = {name: [] for name in args.sides}
    for index in range(args.rounds):
        order = args.sides if index % 2 == 0 else args.sides[::-1]
        for name in order:
            command = [sys.executable, __file__, "--side", name, "--steps", str(args.steps)]
            for flag in ("prompts", "groups", "prompt_len", "new_tokens"):
                command += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            result = json.loads(done.stdout.strip().splitlines()[-1])
            found[name].append(result)
            print(json.dumps({"round": index, **result}), flush=True)
    print("| side | rows x ids | ms per update, median (per round) | loss | trained ids |")
    print("|---|---|---|---:|---:|")
    medians = {}
    for name in args.sides:
        runs = found[name]
        medians[name] = statistics.median(r["ms"] for r in runs)
        per_round = ", ".join(f"{r['ms']:.1f}" for r in runs)
        rows, width = runs[0]["shape"]
        print(
            f"| {name} | {rows} x {width} | {medians[name]:.1f} ({per_round}) | "
            f"{runs[0]['loss']:.6f} | {runs[0]['tokens']:.0f} |"
        )
    first = args.sides[0]
    for name in args.sides[1:]:
        print(f"{first} / {name}: {medians[first] / medians[name]:.2f}x")


if __name__ == "__main__":
    main()
