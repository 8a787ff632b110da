"""Counters of a run (per stage, per edge) and the records the runtime writes to ``metrics.jsonl``.

How a line reaches the file (append, lock, flush) is :class:`dew_pipe._jsonl.JsonLines`, the
run directory's one JSON-lines writer, shared with the Trainer's log; this module decides what
the runtime's records hold.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dew_pipe._jsonl import JsonLines


@dataclass(frozen=True)
class EdgeStats:
    """One edge's counters.

    Attributes:
      name: ``"src.port->dst.port"``.
      capacity: items the edge holds before its producer blocks.
      feedback: whether the edge goes back upstream.
      items: items put so far.
      depth: items queued now; max_depth: the most ever queued (never above capacity).
      put_wait_s: seconds producers spent blocked because the edge was full (backpressure).
      get_wait_s: seconds the consumer waited before this edge delivered an item.
      dropped: items put, or left queued, after the consumer finished.
      closed: the producer finished (or the cycle drained).
    """

    name: str
    capacity: int
    feedback: bool
    items: int
    depth: int
    max_depth: int
    put_wait_s: float
    get_wait_s: float
    dropped: int
    closed: bool


@dataclass(frozen=True)
class StageStats:
    """One stage's counters.

    Attributes:
      state: pending, opening, running, closing, done, failed or cancelled.
      items_in / items_out: items taken from inputs / put on outputs (once per put).
      discarded: items put on an optional output nobody connected.
      busy_s: seconds running its own code (elapsed minus time blocked on queues).
      get_wait_s / put_wait_s: seconds blocked waiting for input / for room downstream.
      elapsed_s: seconds since the stage's thread started.
      error: one line describing its failure, if it failed.
    """

    name: str
    state: str
    items_in: int
    items_out: int
    discarded: int
    busy_s: float
    get_wait_s: float
    put_wait_s: float
    elapsed_s: float
    error: str | None = None


@dataclass(frozen=True)
class FlowSnapshot:
    """Counters of a whole run at one moment.

    Example:
      >>> FlowSnapshot("p", 0.0, {}, {}).to_dict()["pipeline"]
      'p'
    """

    pipeline: str
    elapsed_s: float
    stages: Mapping[str, StageStats]
    edges: Mapping[str, EdgeStats]

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for JSON: stages and edges keyed by name."""
        return {
            "pipeline": self.pipeline,
            "elapsed_s": round(self.elapsed_s, 6),
            "stages": {k: _rounded(dataclasses.asdict(v)) for k, v in self.stages.items()},
            "edges": {k: _rounded(dataclasses.asdict(v)) for k, v in self.edges.items()},
        }

    @property
    def dropped(self) -> int:
        """Items dropped on all edges (consumers that finished before their producers)."""
        return sum(e.dropped for e in self.edges.values())


def _rounded(d: dict[str, Any]) -> dict[str, Any]:
    return {k: round(v, 6) if isinstance(v, float) else v for k, v in d.items()}


def _plain(value: Any) -> Any:
    """JSON fallback: numpy scalars and arrays, paths, dataclasses, sets."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    raise TypeError(f"metrics value {value!r} ({type(value).__name__}) is not JSON-serializable")


class MetricsWriter:
    """Appends one JSON object per line to a file; safe to call from several threads.

    Every line carries ``time`` (Unix seconds), ``elapsed`` (seconds since the writer was
    opened) and ``kind``, then the fields given. Each line is flushed, so ``tail -f`` and a
    crash both see every line written.

    Example:
      >>> import tempfile, os
      >>> w = MetricsWriter(os.path.join(tempfile.mkdtemp(), "m.jsonl"))
      >>> w.write("values", step=1, loss=0.5)
      >>> w.close()
    """

    def __init__(self, path: str | Path) -> None:
        self._lines = JsonLines(path, default=_plain, allow_nan=True)
        self.path = self._lines.path
        self._start = time.monotonic()

    def write(self, kind: str, **fields: Any) -> None:
        """Append one record of the given kind (``flow``, ``values``, ``event``, ...)."""
        record = {"time": time.time(), "elapsed": time.monotonic() - self._start, "kind": kind}
        record.update(fields)
        self._lines.write(record)

    def flow(self, snapshot: FlowSnapshot) -> None:
        """Append a ``flow`` record with the snapshot's stages and edges."""
        self.write("flow", **snapshot.to_dict())

    def close(self) -> None:
        self._lines.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
