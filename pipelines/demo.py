"""Demonstration pipeline: the flow runtime's moving parts on packed-row Arrow batches.

    dew-pipe run pipelines/demo.py [--set batches=40 --set slow_ms=30]

    tasks ─► rollout ─┬─► reward (slow, 2 workers) ─► gate ─► report
               ▲      └─► tokens ──────────────────────────────┘
               └───────── retry (feedback) ◄──── gate

* fan-out: every packed batch the rollout writes goes both to ``reward`` and ``tokens``;
* fan-in: ``report`` reads scored batches and token counts from two ports;
* backpressure: ``reward`` sleeps ``slow_ms`` per batch, so the rollout→reward queue sits
  full and the rollout's put-wait seconds grow in the display;
* feedback: ``gate`` sends every ``resubmit_every``-th task back to the rollout once (as a
  scheduler resubmits a stale or failed rollout) and masks its first attempt out of the batch.

Nothing here trains: the "rollout" draws random ids. ``report`` checks at the end that every
task was admitted exactly once and prints the totals.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from dew_pipe.batches import (
    TASKS_SCHEMA,
    packed_from_arrow,
    packed_schema,
    packed_to_arrow,
    tasks_from_arrow,
    tasks_to_arrow,
)
from dew_pipe.flow import EndOfStream, Map, Pipeline, Port, Source, Stage, StageContext


@dataclass(frozen=True)
class TokenCount:
    """Control message on the tokens→report edge: real ids in one packed batch."""

    ids: int
    slots: int


def _task_batches(count: int, per_batch: int, seed: int):
    rng = np.random.default_rng(seed)
    for b in range(count):
        rows = [
            {"task_id": b * per_batch + i, "prompt": rng.integers(1, 500, rng.integers(4, 17))}
            for i in range(per_batch)
        ]
        yield tasks_to_arrow(rows)


def _pack(chains: list[tuple[int, int, np.ndarray, int]], width: int, rows: int) -> dict:
    """First-fit ``(task, attempt, prompt, sampled length)`` chains into ``[rows, width]``."""
    cols = packed_schema(width).names
    out = {n: np.zeros((rows, width), np.float32 if "prob" in n or n in ("advantages", "session_weights") else np.int32) for n in cols}  # fmt: skip
    fill = [0] * rows
    rng = np.random.default_rng([c[0] for c in chains])
    for task, attempt, prompt, sampled in chains:
        n = len(prompt) + sampled
        row = next(r for r in range(rows) if fill[r] + n <= width)
        lo, hi = fill[row], fill[row] + n
        seg = 1 + int(out["text_segment_ids"][row].max())
        out["input_ids"][row, lo:hi] = np.concatenate([prompt, rng.integers(1, 500, sampled)])
        out["text_segment_ids"][row, lo:hi] = seg
        out["text_positions"][row, lo:hi] = np.arange(n)
        out["response_mask"][row, lo + len(prompt) : hi] = 1
        logp = -rng.random(sampled, np.float32)
        out["old_log_probs"][row, lo + len(prompt) : hi] = logp
        out["behavior_log_probs"][row, lo + len(prompt) : hi] = logp
        out["versions"][row, lo:hi] = attempt  # the attempt stands in for a policy version
        out["session_index"][row, lo:hi] = task
        out["session_weights"][row, lo:hi] = 1.0
        fill[row] = hi
    return out


class Rollout(Stage):
    """Turns task batches (new or resubmitted) into packed-row batches of random chains."""

    def __init__(self, width: int, rows: int):
        super().__init__(
            "rollout",
            inputs={"tasks": TASKS_SCHEMA, "retry": Port(TASKS_SCHEMA, required=False)},
            outputs={"rows": packed_schema(width)},
        )  # fmt: skip
        self.width, self.rows = width, rows

    def run(self, ctx: StageContext) -> None:
        while True:
            got = ctx.get_any()  # EndOfStream once tasks ended and the retry cycle drained
            if got is None:
                continue
            port, task_batch = got
            attempt = 1 if port == "retry" else 0
            rng = np.random.default_rng(task_batch.column("task_id").to_numpy())
            chains = [
                (t["task_id"], attempt, t["prompt"], int(rng.integers(8, 49)))
                for t in tasks_from_arrow(task_batch)
            ]
            ctx.put("rows", packed_to_arrow(_pack(chains, self.width, self.rows)))


def _reward(width: int, slow_ms: float):
    def score(rb: pa.RecordBatch) -> pa.RecordBatch:
        cols = dict(packed_from_arrow(rb))
        ids, mask, task = cols["input_ids"], cols["response_mask"], cols["session_index"]
        advantages = np.zeros_like(cols["advantages"])
        for t in np.unique(task[mask == 1]):
            chain = (task == t) & (mask == 1)
            advantages[(task == t) & (cols["text_segment_ids"] > 0)] = (ids[chain] % 2 == 0).mean()
        on = cols["text_segment_ids"] > 0
        advantages[on] -= advantages[on].mean()  # centre over the batch
        cols["advantages"] = advantages
        time.sleep(slow_ms / 1000)  # the slow part: a verifier subprocess, a network call
        return packed_to_arrow(cols)

    return score


def _count_tokens(width: int):
    def count(rb: pa.RecordBatch) -> TokenCount:
        real = int((packed_from_arrow(rb)["text_segment_ids"] > 0).sum())
        return TokenCount(real, rb.num_rows * width)

    return count


class Gate(Stage):
    """Admits scored chains; sends every ``every``-th task's first attempt back once."""

    def __init__(self, width: int, every: int):
        schema = packed_schema(width)
        super().__init__(
            "gate",
            inputs={"scored": schema},
            outputs={"accepted": schema, "retry": TASKS_SCHEMA},
        )
        self.every = every

    def run(self, ctx: StageContext) -> None:
        for rb in ctx.read("scored"):
            cols = dict(packed_from_arrow(rb))
            task, seg, attempt = cols["session_index"], cols["text_segment_ids"], cols["versions"]
            retry = []
            for t in np.unique(task[seg > 0]):
                chain = (task == t) & (seg > 0)
                if self.every and t % self.every == 0 and attempt[chain].max() == 0:
                    prompt = cols["input_ids"][chain & (cols["response_mask"] == 0)]
                    retry.append({"task_id": int(t), "prompt": prompt})
                    for name in ("response_mask", "session_weights"):  # masked out, shape kept
                        cols[name] = np.where(chain, 0, cols[name]).astype(cols[name].dtype)
            if retry:
                ctx.put("retry", tasks_to_arrow(retry))
            ctx.put("accepted", packed_to_arrow(cols))


class Report(Stage):
    """Fan-in of admitted batches and token counts; checks every task was admitted once."""

    def __init__(self, width: int, tasks: int):
        super().__init__("report", inputs={"accepted": packed_schema(width), "tokens": TokenCount})
        self.tasks = tasks

    def open(self) -> None:
        self.admitted: dict[int, int] = {}
        self.ids = self.slots = self.batches = 0

    def run(self, ctx: StageContext) -> None:
        while True:
            try:
                got = ctx.get_any()
            except EndOfStream:
                break
            if got is None:  # one of the two inputs ended; keep reading the other
                continue
            port, item = got
            if port == "tokens":
                self.ids, self.slots = self.ids + item.ids, self.slots + item.slots
                continue
            cols = packed_from_arrow(item)
            self.batches += 1
            for t in np.unique(cols["session_index"][cols["response_mask"] == 1]):
                self.admitted[int(t)] = self.admitted.get(int(t), 0) + 1
        self._check()

    def _check(self) -> None:
        twice = [t for t, n in self.admitted.items() if n != 1]
        missing = self.tasks - len(self.admitted)
        if twice or missing:
            raise RuntimeError(
                f"admitted {len(self.admitted)} of {self.tasks} tasks; twice: {twice[:5]}"
            )
        share = self.ids / max(self.slots, 1)
        print(f"report: {self.batches} batches admitted every one of {self.tasks} tasks once; "
              f"{share:.1%} of row slots hold real ids")  # fmt: skip


def pipeline(
    batches: int = 24,
    tasks_per_batch: int = 8,
    width: int = 128,
    slow_ms: float = 60.0,
    workers: int = 2,
    resubmit_every: int = 4,
    seed: int = 0,
) -> Pipeline:
    """The demo graph (settings: see the module docstring; ``slow_ms`` per reward batch)."""
    rows = tasks_per_batch  # one chain of <= 64 ids per task always fits a row of >= 64
    if width < 64:
        raise ValueError(f"width={width}: expected >= 64 (chains are up to 64 ids)")
    tasks = batches * tasks_per_batch
    p = Pipeline("demo")
    tasks_source = lambda: _task_batches(batches, tasks_per_batch, seed)  # noqa: E731
    p.add(Source("tasks", tasks_source, output_type=TASKS_SCHEMA))
    p.add(Rollout(width, rows))
    schema = packed_schema(width)
    p.add(Map("reward", _reward(width, slow_ms), input_type=schema, workers=workers))
    p.add(Map("tokens", _count_tokens(width), input_type=schema, output_type=TokenCount))
    p.add(Gate(width, resubmit_every))
    p.add(Report(width, tasks))
    # Capacities: 2 batches let the producer run one batch ahead of a busy consumer, which is
    # all the overlap a steady pipeline needs; more would only hide the backpressure.
    p.connect("tasks", "rollout.tasks", capacity=2)
    p.connect("rollout", "reward", capacity=2)
    p.connect("rollout", "tokens", capacity=2)
    p.connect("reward", "gate", capacity=2)
    p.connect("gate.accepted", "report.accepted", capacity=2)
    p.connect("tokens", "report.tokens", capacity=4)
    # The retry edge closes the cycle rollout → reward → gate → rollout. It must hold every
    # batch the cycle can have in flight, or gate and rollout could each wait on the other's
    # full queue: 2 + 2 (edges) + workers (reward pool) + 3 (one per stage in hand).
    p.connect("gate.retry", "rollout.retry", capacity=7 + workers, feedback=True)
    return p
