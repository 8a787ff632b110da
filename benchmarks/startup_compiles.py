"""Where the GRPO pipeline's start-up goes: compile and run time of the server's halves.

Loads the weak checkpoint of ``benchmarks/grpo_time_to_accuracy.py`` and times
`engine_steps.prefill` for every joining bucket (1 .. 128 requests, prompts 16 wide), then
`engine_steps.advance` over 128 rows (8 steps per call), the first call of each being its
compile. Run with ``XLA_FLAGS=--xla_backend_optimization_level=0`` to see what a lower
optimisation level trades.

    .venv/bin/python benchmarks/startup_compiles.py [checkpoint]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import jax
import numpy as np
from machine import print_machine

from dew_pipe.inference.decoding import serving_cache
from dew_pipe.inference.servers import engine_steps
from dew_pipe.models import load_pretrained
from dew_pipe.sampling import Sampling

ROOT = Path(__file__).resolve().parents[1]
ROWS, CAPACITY, WIDTH = 128, 31, 16


def main() -> None:
    print_machine()
    path = sys.argv[1] if len(sys.argv) > 1 else ROOT / "runs/grpo-time-to-accuracy/checkpoint"
    pretrained = load_pretrained(path)
    model = pretrained.model
    device = jax.devices()[0]
    variables = jax.device_put(pretrained.variables, device)
    cache = jax.device_put(serving_cache(model, model.init_cache(ROWS, CAPACITY)), device)
    state = jax.device_put(engine_steps.empty_slots(ROWS), device)
    sampling = Sampling(eos_id=2)
    for joined in (1, 2, 4, 8, 16, 32, 64, 128):
        host = (
            np.arange(joined, dtype=np.int32),
            np.full((joined, WIDTH), 3, np.int32),
            np.full(joined, 10, np.int32),
            np.full(joined, 8, np.int32),
            np.zeros(joined, np.uint32),
        )
        args = jax.device_put(host, device)
        times = []
        for _ in range(21):  # the first call compiles
            start = time.perf_counter()
            cache, state, first = engine_steps.prefill(
                model, variables, cache, state, *args, sampling=sampling, support=False
            )
            jax.block_until_ready(first)
            times.append(time.perf_counter() - start)
        print(
            f"prefill {joined:3d} rows: compile {times[0]:.2f} s, "
            f"run {1000 * np.median(times[1:]):.2f} ms",
            flush=True,
        )
    keep = jax.device_put(np.ones(ROWS, bool), device)
    join = jax.device_put(np.int32(0), device)  # no early stop: the full 8 steps
    for call in range(6):  # the first call compiles
        start = time.perf_counter()
        cache, _, out = engine_steps.advance(
            model, variables, cache, state, keep, join, steps=8, sampling=sampling, support=False
        )
        jax.block_until_ready(out)
        print(f"advance call {call}: {1000 * (time.perf_counter() - start):.2f} ms", flush=True)
        state = jax.device_put(engine_steps.empty_slots(ROWS), device)
        cache, state, _ = engine_steps.prefill(
            model, variables, cache, state, *args, sampling=sampling, support=False
        )


if __name__ == "__main__":
    main()
