"""Where GRPO's signal is: per-problem pass rates of a checkpoint on the arithmetic task.

GRPO learns only from groups whose rewards differ: a problem the model always solves, or
never does, has zero advantage in every completion. This script measures, for a saved
checkpoint (``Pretrained.save`` layout, e.g. the weak start that
``benchmarks/grpo_time_to_accuracy.py`` keeps in ``runs/grpo-time-to-accuracy/checkpoint``),
how the training problems split into those three kinds, overall and by the number of carries
the sum needs (the skill SFT learns in a sudden jump):

- greedy exact match on the held-out test problems (the benchmark's measure);
- for ``--problems`` training problems, ``--groups`` completions each at ``--temperature``:
  the mean reward, and the share of problems whose group is all wrong, mixed (GRPO's signal)
  or all right;
- the same split per carry count (0 to ``digits``), with each count's share of problems.

Usage (from the repository root)::

    .venv/bin/python benchmarks/grpo_signal.py runs/grpo-time-to-accuracy/checkpoint --seed 2
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from machine import print_machine


def carries(prompt: str) -> int:
    """Carries of ``a+b=`` done column by column (0 for anything but an addition)."""
    expression = prompt.rstrip("=")
    if "+" not in expression:
        return 0
    a, b = (int(x) for x in expression.split("+"))
    count = carry = 0
    while a or b:
        carry = (a % 10 + b % 10 + carry) // 10
        count += carry
        a, b = a // 10, b // 10
    return count


def split_groups(rewards: np.ndarray) -> tuple[float, float, float]:
    """Shares of groups (rows of ``rewards``) that are all wrong, mixed and all right."""
    right = rewards.sum(axis=1)
    groups = rewards.shape[1]
    return (
        float(np.mean(right == 0)),
        float(np.mean((right > 0) & (right < groups))),
        float(np.mean(right == groups)),
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", type=Path, help="a Pretrained.save directory")
    parser.add_argument("--seed", type=int, default=2, help="the task's seed")
    parser.add_argument("--digits", type=int, default=3)
    parser.add_argument("--problems", type=int, default=1024, help="training problems")
    parser.add_argument("--groups", type=int, default=8, help="completions per problem")
    parser.add_argument("--temperature", type=float, default=1.0)
    args = parser.parse_args(argv)
    print_machine()

    import jax

    from dew_pipe.inference.generation import generate_in_chunks
    from dew_pipe.models import load_pretrained
    from dew_pipe.sampling import Sampling
    from dew_pipe.tasks import ArithmeticTask
    from dew_pipe.tasks.arithmetic import reward

    task = ArithmeticTask(seed=args.seed, digits=args.digits)
    pretrained = load_pretrained(args.checkpoint)
    model, variables = pretrained.model, pretrained.variables
    held_out = task.evaluate(model, variables, "test")

    prompts, lengths = task.prompt_arrays("train", args.problems)
    repeated = np.repeat(prompts, args.groups, axis=0)
    repeated_lengths = np.repeat(lengths, args.groups)
    sampling = Sampling(eos_id=task.eos_id, temperature=args.temperature)
    rows = generate_in_chunks(
        model, variables, repeated, repeated_lengths, task.max_new_tokens,
        jax.random.key(args.seed), sampling, batch=512, pad_id=task.pad_id,
    )  # fmt: skip
    texts = [task.decode(row) for row in rows]
    problems = task.problems("train", args.problems)
    truths = np.repeat(np.array(problems.ground_truths()), args.groups)
    info = '{"split": "train"}'
    scores = np.array(
        [reward(task.data_source, t, g, info) for t, g in zip(texts, truths, strict=True)]
    ).reshape(args.problems, args.groups)
    kinds = np.array([carries(p) for p in problems.prompts()])

    print(f"checkpoint: {args.checkpoint} (task seed {args.seed}, {args.digits} digits)")
    print(f"held-out greedy exact match: {held_out:.1%}")
    wrong, mixed, right = split_groups(scores)
    print(
        f"{args.problems} training problems x {args.groups} completions at temperature "
        f"{args.temperature}: mean reward {scores.mean():.3f}; groups all wrong {wrong:.1%}, "
        f"mixed {mixed:.1%} (GRPO's signal), all right {right:.1%}"
    )
    print("| carries | share of problems | mean reward | all wrong | mixed | all right |")
    print("|---:|---:|---:|---:|---:|---:|")
    for count in range(args.digits + 1):
        chosen = kinds == count
        if not chosen.any():
            continue
        w, m, r = split_groups(scores[chosen])
        print(
            f"| {count} | {chosen.mean():.1%} | {scores[chosen].mean():.3f} | {w:.1%} | "
            f"{m:.1%} | {r:.1%} |"
        )


if __name__ == "__main__":
    main()
