"""SFT on the generated arithmetic task: held-out exact match against steps, wall and CPU time.

Runs :func:`dew_pipe.tasks.recipe.train_sft` with one recipe and, every ``--probe-every``
steps, evaluates greedy exact match on the held-out test problems from a host hook that sees
the current parameters (the probe's own time is measured and left out of the training times).
Prints one table row per probe: steps, training wall seconds, training CPU seconds of this
process (user + system, all threads), the 1-minute load average, and the exact match. With
``--groups G`` it also samples G completions per test prompt at temperature 1 and reports
their mean reward, pass@G and the share of prompts whose G rewards are not all equal (the
groups that would give GRPO a nonzero advantage).

The machine may be shared: wall seconds then stretch with the load, CPU seconds much less.

Example:
    .venv/bin/python benchmarks/arithmetic_sft.py --digits 3 --steps 1500 --probe-every 250
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import time

import jax
import numpy as np
from machine import print_machine

from dew_pipe.sampling import Sampling
from dew_pipe.tasks import ArithmeticTask
from dew_pipe.tasks.recipe import SFTRecipe, train_sft


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class Probe:
    """A Trainer host hook that evaluates exact match every ``every`` steps."""

    def __init__(self, task: ArithmeticTask, every: int, n: int, groups: int) -> None:
        self.task, self.every, self.n, self.groups = task, every, n, groups
        self.model = None
        self.rows: list[dict[str, float]] = []
        self.paused_wall = self.paused_cpu = 0.0
        self.wall0 = self.cpu0 = 0.0

    def start(self) -> None:
        self.wall0, self.cpu0 = time.perf_counter(), _cpu()

    def measure(self, params, step: int) -> None:
        wall, cpu = time.perf_counter(), _cpu()
        accuracy = self.task.evaluate(self.model, params, "test", self.n)
        row = {
            "step": step,
            "wall_s": round(wall - self.wall0 - self.paused_wall, 1),
            "cpu_s": round(cpu - self.cpu0 - self.paused_cpu, 1),
            "load1": round(os.getloadavg()[0], 2),
            "exact_match": round(accuracy, 4),
        }
        row["eval_wall_s"] = round(time.perf_counter() - wall, 2)
        if self.groups:
            row.update(self.sampled(params, step))
        self.rows.append(row)
        print(json.dumps(row), flush=True)
        self.paused_wall += time.perf_counter() - wall
        self.paused_cpu += _cpu() - cpu

    def sampled(self, params, step: int) -> dict[str, float]:
        """Rewards of ``groups`` completions per test prompt at temperature 1: how much
        signal GRPO would find (a group whose rewards are all equal has no advantage)."""
        rewards = np.stack(
            [
                self.task.score(
                    self.task.completions(
                        self.model,
                        params,
                        "test",
                        self.n,
                        sampling=Sampling(temperature=1.0),
                        key=jax.random.key(1000 * step + g),
                    )
                )
                for g in range(self.groups)
            ],
            axis=1,
        )
        mixed = (rewards.min(axis=1) < rewards.max(axis=1)).mean()
        return {
            "sampled_reward": round(float(rewards.mean()), 4),
            f"pass@{self.groups}": round(float(rewards.max(axis=1).mean()), 4),
            "mixed_groups": round(float(mixed), 4),
        }

    def __call__(self, state, batch, key):
        step = int(state.step)
        if step > 0 and step % self.every == 0:
            self.measure(state.params, step)
        return batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--digits", type=int, default=3)
    parser.add_argument("--operations", default="+")
    parser.add_argument("--format", default="reversed", choices=("plain", "reversed"))
    parser.add_argument("--probe-every", type=int, default=250)
    parser.add_argument("--probe-n", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--groups", type=int, default=0, help="also sample this many completions per prompt"
    )
    fields = {f.name: f for f in dataclasses.fields(SFTRecipe)}
    for name, field in fields.items():
        parser.add_argument("--" + name.replace("_", "-"), type=type(field.default), default=None)
    args = parser.parse_args()
    overrides = {n: getattr(args, n) for n in fields if getattr(args, n) is not None}
    recipe = SFTRecipe(**overrides)
    task = ArithmeticTask(
        seed=args.seed,
        digits=args.digits,
        operations=args.operations,
        answer_format=args.format,
    )
    print(json.dumps({"task": vars(args) | {"recipe": dataclasses.asdict(recipe)}}), flush=True)
    probe = Probe(task, args.probe_every, args.probe_n, args.groups)
    probe.model = recipe.model(task)
    probe.start()
    model, state = train_sft(task, recipe, key=jax.random.key(args.seed), rollout=probe)
    jax.block_until_ready(state.params)
    probe.measure(state.params, int(state.step))


if __name__ == "__main__":
    print_machine()
    main()
