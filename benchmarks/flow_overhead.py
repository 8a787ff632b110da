"""Per-edge cost of the flow runtime: one packed-rows batch through 5 identity stages.

A ``[256, 2048]`` packed-rows batch (11 int32/float32 columns, 23 MB) goes from a source
through a chain of 5 identity map stages into a sink: 6 bounded edges, 7 threads. The same
run calls 5 identity functions directly on the batch as the baseline. Reported: microseconds
per batch per edge, ``(pipeline - direct) / (batches * edges)``, for a few edge capacities;
and a check, on every batch of a separate pass, that each column the sink receives still
points at the numpy buffer the batch was built from (no copy anywhere on the way).

    python benchmarks/flow_overhead.py [--batches 3000] [--capacities 1,4,16]

Goal: <= 50 us per batch per edge.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from machine import print_machine

from dew_pipe.batches import packed_from_arrow, packed_schema, packed_to_arrow
from dew_pipe.flow import Map, Pipeline, Sink, Source

ROWS, WIDTH, STAGES = 256, 2048, 5


def packed_batch():
    schema = packed_schema(WIDTH)
    rng = np.random.default_rng(0)
    arrays = {}
    for field in schema:
        dtype = np.float32 if str(field.type.value_type) == "float" else np.int32
        arrays[field.name] = rng.integers(0, 1000, (ROWS, WIDTH)).astype(dtype)
    return arrays, packed_to_arrow(arrays), schema


def identity(batch):
    return batch


def chain(schema, batch, count, capacity, sink_fn):
    p = Pipeline("bench")
    stages = [Source("src", lambda: (batch for _ in range(count)), output_type=schema)]
    stages += [Map(f"id{i}", identity, input_type=schema) for i in range(STAGES)]
    stages.append(Sink("sink", sink_fn, input_type=schema))
    p.chain(*stages, capacity=capacity)
    return p


def direct(batch, count):
    fns = [identity] * STAGES
    start = time.perf_counter()
    for _ in range(count):
        out = batch
        for fn in fns:
            out = fn(out)
    return time.perf_counter() - start


def check_no_copy(arrays, batch, schema, count):
    addresses = {name: a.ctypes.data for name, a in arrays.items()}
    seen = []

    def verify(received):
        for name, view in packed_from_arrow(received).items():
            if view.ctypes.data != addresses[name]:
                raise AssertionError(f"column {name!r} was copied on the way")
        seen.append(1)

    chain(schema, batch, count, 2, verify).run(timeout=120)
    return len(seen)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=3000)
    parser.add_argument("--capacities", default="1,4,16")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs")
    args = parser.parse_args()
    arrays, batch, schema = packed_batch()
    edges = STAGES + 1
    mb = sum(a.nbytes for a in arrays.values()) / 2**20
    print(f"batch [{ROWS}, {WIDTH}], {len(arrays)} columns, {mb:.1f} MiB; {STAGES} identity "
          f"stages, {edges} edges; {args.batches} batches; best of {args.repeats}")  # fmt: skip
    checked = check_no_copy(arrays, batch, schema, 200)
    print(f"no-copy check: all {len(arrays)} column buffers of {checked}/200 batches unchanged")
    base = min(direct(batch, args.batches) for _ in range(args.repeats))
    print(f"direct calls: {base / args.batches * 1e6:.2f} us per batch ({STAGES} functions)")
    for capacity in (int(c) for c in args.capacities.split(",")):
        best = float("inf")
        for _ in range(args.repeats):
            p = chain(schema, batch, args.batches, capacity, lambda b: None)
            start = time.perf_counter()
            snap = p.run(timeout=600)
            best = min(best, time.perf_counter() - start)
            assert snap.stages["sink"].items_in == args.batches
        per_edge = (best - base) / (args.batches * edges) * 1e6
        print(f"capacity {capacity:>2}: pipeline {best / args.batches * 1e6:7.1f} us per batch, "
              f"{per_edge:5.1f} us per batch per edge, {best / base:6.0f}x direct")  # fmt: skip


if __name__ == "__main__":
    print_machine()
    main()
