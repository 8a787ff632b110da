"""Real-token share of packed rows, and the cost of packing, on a skewed length mix.

The mix is what agentic and RLVR batches look like: most chains short (a prompt and a short
answer), a few that run close to the row width (long tool sessions, budget-hit draws). Each
batch is packed three ways in the same run:

- ``pack`` (first-fit decreasing, what dew_pipe uses),
- first-fit in arrival order, random and by finish time (shortest first, as an asynchronous
  scheduler admits them): the tail of each late near-width row stays empty,
- one chain per row, right-padded to the width (what a per-sequence layout pays).

It reports the real-token share of each (real ids / (rows * width)) and pack's time per
session at several batch sizes. Goal: pack >= 97% real tokens.

    python benchmarks/packing.py [--width 4096] [--sizes 64 512 4096] [--seed 0]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from machine import print_machine

from dew_pipe.objectives.rl.sessions import Call, Session, chain_lengths, pack, rows_needed


def skewed_sessions(n: int, width: int, rng: np.random.Generator) -> list[Session]:
    """n one- or two-call sessions: 90% short chains, 10% within 15% of the width."""
    sessions = []
    for k in range(n):
        long = rng.random() < 0.10
        total = (
            int(rng.integers(int(0.85 * width), width + 1)) if long else int(rng.integers(48, 769))
        )
        prompt = int(rng.integers(16, max(17, total // 2)))
        sampled = total - prompt
        ids = rng.integers(0, 32000, size=total).astype(np.int32)
        lp = -rng.random(sampled).astype(np.float32)
        calls = [Call(ids[:prompt], ids[prompt:], lp, "stop", 0)]
        if rng.random() < 0.3 and prompt > 8:  # a first turn the second one extends
            split = prompt // 2
            calls.insert(0, Call(ids[: split - 4], ids[split - 4 : split], lp[:4], "stop", 0))
        sessions.append(Session(k // 8, 0, k % 8, 0, calls, "COMPLETED", float(rng.random())))
    return sessions


def first_fit_in_order(lengths: np.ndarray, width: int) -> int:
    """Rows plain first-fit needs when chains arrive in order (the comparison baseline)."""
    free: list[int] = []
    for length in lengths.tolist():
        for r, room in enumerate(free):
            if room >= length:
                free[r] -= length
                break
        else:
            free.append(width - length)
    return len(free)


def measure(n: int, width: int, seed: int, repeats: int = 3) -> dict[str, float]:
    sessions = skewed_sessions(n, width, np.random.default_rng(seed))
    lengths = chain_lengths(sessions, width)
    real = int(lengths.sum())
    # an asynchronous scheduler admits sessions as they finish, so long ones tend to come last
    by_finish = np.sort(lengths)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        batch = pack(sessions, width)
        times.append(time.perf_counter() - start)
    rows = batch["input_ids"].shape[0]
    assert rows == rows_needed(lengths, width)
    assert np.count_nonzero(batch["text_segment_ids"]) == real
    start = time.perf_counter()
    rows_needed(chain_lengths(sessions, width), width)
    count_time = time.perf_counter() - start
    return {
        "sessions": n,
        "chains": int(lengths.size),
        "rows": rows,
        "pack_share": real / (rows * width),
        "bound_share": real / (-(-real // width) * width),
        "first_fit_share": real / (first_fit_in_order(lengths, width) * width),
        "first_fit_finish_share": real / (first_fit_in_order(by_finish, width) * width),
        "padded_share": real / (lengths.size * width),
        "us_per_session": 1e6 * min(times) / n,
        "rows_needed_us_per_session": 1e6 * count_time / n,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 512, 4096])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"width {args.width}; 90% chains of 48-768 ids, 10% of 85-100% of the width")
    print("real-token share: pack (first-fit decreasing); bound = ceil(real / width) rows;")
    print("first-fit in random arrival order, and in finish order (shortest first);")
    print("padded = one chain per row. Times: pack, and rows_needed(chain_lengths(...)).")
    header = (
        f"{'sessions':>8} {'chains':>6} {'rows':>5} {'pack':>7} {'bound':>7} {'ff rand':>7} "
        f"{'ff fin':>7} {'padded':>7} {'vs pad':>7} {'pack us/s':>9} {'count us/s':>10}"
    )
    print(header)
    for n in args.sizes:
        m = measure(n, args.width, args.seed)
        print(
            f"{m['sessions']:>8} {m['chains']:>6} {m['rows']:>5} {m['pack_share']:>7.2%} "
            f"{m['bound_share']:>7.2%} {m['first_fit_share']:>7.2%} "
            f"{m['first_fit_finish_share']:>7.2%} {m['padded_share']:>7.2%} "
            f"{m['pack_share'] / m['padded_share']:>6.2f}x {m['us_per_session']:>9.1f} "
            f"{m['rows_needed_us_per_session']:>10.1f}"
        )


if __name__ == "__main__":
    print_machine()
    main()
