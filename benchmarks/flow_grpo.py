"""Flow-GRPO throughput at the default size of ``pipelines/flow_grpo.py``.

    .venv/bin/python benchmarks/flow_grpo.py [--repeats 20]

Measures, on the pipeline's default model (SimpleDiT, 8x8 RGB, width 32, 2 blocks) and batch
(4 source rows x 8 samples, a 6-point grid, every transition trained):

* ``samples/s``: SDE samples drawn by ``sample_trajectory`` (one compiled scan per batch);
* ``rollout/s``: whole ``FlowRollout`` calls (sampling, decoding, the reward, the layout);
* ``update/s``: compiled Flow-GRPO updates (``Trainer.train_step``) on one rollout batch;
* ``step/s``: rollout then update, as ``Trainer.fit`` runs them;

and, as the baseline measured in the same run, the flow-matching update of the same model on
a batch of as many images (``DiffusionObjective``), printing the Flow-GRPO update's cost as
a multiple of it (it differentiates the model at ``T`` transitions per sample, the baseline
at one noise level per image). Each figure is the median of ``--repeats`` timed calls after
one warm-up call (which compiles).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import jax
import numpy as np
import optax
from machine import print_machine

from dew_pipe import Trainer, presets
from dew_pipe.cli import load_file
from dew_pipe.objectives import DiffusionObjective
from dew_pipe.objectives.rl import FlowGRPOObjective, FlowRollout, sample_trajectory

PIPELINE = Path(__file__).resolve().parents[1] / "pipelines" / "flow_grpo.py"


def _median_seconds(call, repeats: int) -> float:
    jax.block_until_ready(call())  # warm-up: compiles
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    module = load_file(PIPELINE)
    job = module.pipeline()
    s = job.settings
    inputs = job._inputs()
    rows = s.sources * s.groups
    objective = FlowGRPOObjective(job.model, presets.Flow()(), inputs, beta=s.beta, steps=s.steps)
    rollout = FlowRollout(objective, module.colour_reward(s.target), s.groups, s.steps)
    trainer = Trainer(objective, optax.adam(s.learning_rate), key=jax.random.key(0))
    state = trainer.initial_state()
    source = {"image": np.zeros((s.sources, s.size, s.size, 3), np.uint8)}
    keys = iter(jax.random.split(jax.random.key(1), 4 * (args.repeats + 1)))

    sample = _median_seconds(
        lambda: (
            sample_trajectory(objective, state.params, next(keys), rows=rows, steps=s.steps).states
        ),
        args.repeats,
    )
    roll = _median_seconds(lambda: rollout(state, source, next(keys))["states"], args.repeats)
    batch = rollout(state, source, next(keys))
    holder = {"state": state}

    def update():
        holder["state"], metrics = trainer.train_step(holder["state"], batch)
        return metrics["loss"]

    grpo_update = _median_seconds(update, args.repeats)

    def step():
        fresh = rollout(holder["state"], source, next(keys))
        holder["state"], metrics = trainer.train_step(holder["state"], fresh)
        return metrics["loss"]

    grpo_step = _median_seconds(step, args.repeats)

    matching = DiffusionObjective(job.model, presets.Flow()(), inputs, steps=s.steps)
    baseline_trainer = Trainer(matching, optax.adam(s.learning_rate), key=jax.random.key(0))
    images = {"image": module.shapes(np.random.default_rng(0), rows, s.size)}
    base = {"state": baseline_trainer.initial_state()}

    def baseline():
        base["state"], metrics = baseline_trainer.train_step(base["state"], images)
        return metrics["loss"]

    baseline_update = _median_seconds(baseline, args.repeats)
    transitions = batch["states"].shape[1]
    print(
        f"Flow-GRPO at the pipeline's default size: {rows} samples of {s.size}x{s.size}x3, "
        f"{s.steps}-point grid, {transitions} trained transitions per sample; "
        f"median of {args.repeats}; {jax.devices()[0].platform}"
    )
    print("| measure | seconds | per second |\n|---|---:|---:|")
    print(f"| sample_trajectory ({rows} samples) | {sample:.4f} | {rows / sample:.0f} samples/s |")
    print(f"| FlowRollout call | {roll:.4f} | {1 / roll:.1f} rollouts/s |")
    print(f"| Flow-GRPO update | {grpo_update:.4f} | {1 / grpo_update:.1f} updates/s |")
    print(f"| rollout + update | {grpo_step:.4f} | {1 / grpo_step:.1f} steps/s |")
    print(
        f"| flow-matching update (baseline) | {baseline_update:.4f} | {1 / baseline_update:.1f} updates/s |"
    )
    print(
        f"Flow-GRPO update / flow-matching update: {grpo_update / baseline_update:.2f}x "
        f"({transitions} transitions per sample against 1 noise level per image)"
    )


if __name__ == "__main__":
    print_machine()
    main()
