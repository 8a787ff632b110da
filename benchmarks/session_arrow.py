"""The cost of moving sessions between stages: Session records to Arrow and back.

Every GRPO batch crosses two stage boundaries as Arrow (rollout -> pack carries the stamped
sessions), so writing and reading a batch is paid per update on the trainer's machine, under
the same interpreter lock as the rollout server and the update's dispatch. Both directions
are timed in the same run against the row-checked path they replaced:

- write: ``to_arrow`` (records are checked when made, so their rows go straight to the
  columns) against ``sessions_to_arrow`` over ``session_row`` rows (every field of every
  row checked again);
- read: ``from_arrow`` (whole columns checked, records built without re-running their
  checks) against the row-by-row reader (each record through ``Session``/``Call`` checks).

The batch is the GRPO benchmark's shape: ``--sessions`` one-call sessions of an 8-id prompt
and 1-5 sampled ids with behavior and raw log-probabilities.

    python benchmarks/session_arrow.py [--sessions 1024] [--repeats 30]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from machine import print_machine

from dew_pipe.objectives.rl import session_arrow
from dew_pipe.objectives.rl.session_arrow import session_row
from dew_pipe.objectives.rl.sessions import Call, Session, from_arrow, to_arrow
from dew_pipe.rollout_batches import sessions_to_arrow


def batch(n: int, rng: np.random.Generator) -> list[Session]:
    out = []
    for i in range(n):
        k = int(rng.integers(1, 6))
        call = Call(
            rng.integers(0, 18, 8).astype(np.int32),
            rng.integers(0, 18, k).astype(np.int32),
            -rng.random(k).astype(np.float32),
            "stop",
            3,
            log_probs=-rng.random(k).astype(np.float32),
        )
        out.append(Session(i // 8, i // 8, i % 8, 0, [call], "COMPLETED", float(i % 2)))
    return out


def best_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    sessions = batch(args.sessions, np.random.default_rng(0))
    record = to_arrow(sessions)
    assert from_arrow(record) == sessions == session_arrow._row_by_row(record)
    rows = [
        (
            "write",
            lambda: to_arrow(sessions),
            lambda: sessions_to_arrow(map(session_row, sessions)),
        ),
        ("read", lambda: from_arrow(record), lambda: session_arrow._row_by_row(record)),
    ]
    print(f"{args.sessions} sessions, best of {args.repeats}")
    print("| direction | dew_pipe ms | row-checked ms | ratio |")
    print("|---|---:|---:|---:|")
    for name, fast, checked in rows:
        a, b = best_ms(fast, args.repeats), best_ms(checked, args.repeats)
        print(f"| {name} | {a:.1f} | {b:.1f} | {b / a:.1f}x |")


if __name__ == "__main__":
    print_machine()
    main()
