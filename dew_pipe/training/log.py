"""What fit reports: interval averages to metrics.jsonl, a callback and a progress bar.

Lines reach ``metrics.jsonl`` through :class:`dew_pipe._jsonl.JsonLines`, the run
directory's one JSON-lines writer (the flow runtime writes its records through it too);
this module decides what a training record holds.

Per-step metrics stay on the device until a record is due (every ``log_every``
steps), then one ``device_get`` fetches them all: logging adds a single host-device
sync point per record, not per step.

A training record (one JSON object per line of ``metrics.jsonl``)::

    step, updates        counters after the interval's last step
    loss, grad_norm, ... means over the interval's finite steps
    tokens               loss-bearing tokens in the interval (objective's "tokens")
    tokens_per_s         tokens / seconds
    seconds, elapsed     wall seconds of the interval, and since fit started
    learning_rate        when the optimizer stores one (optax.inject_hyperparams)
    epoch                examples consumed / Dataset.records, when records is known
    skipped_nonfinite    batches the NaN guard has skipped in this run so far

Validation records carry ``step``, ``updates`` and the objective's summary under
``val/<name>``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
)

from dew_pipe._jsonl import JsonLines

__all__ = ["TrainLog"]

# Flags the update returns for the loop's own use; never averaged into a record.
_FLAGS = ("finite", "committed")


def _number(value: Any) -> float | int | None:
    """A JSON-safe number: ints stay ints, None and non-finite floats become None."""
    if value is None:
        return None
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return int(value)
    value = float(value)
    return value if math.isfinite(value) else None


class TrainLog:
    """Collects per-step metrics and writes records.

    Args:
        run_dir: where ``metrics.jsonl`` is appended; ``None`` writes no file.
        callback: called with every record (a dict of floats), or ``None``.
        progress: show a rich progress bar; ``None`` shows it on a terminal or notebook.
        steps: the step ``fit`` runs to.
        start: the step ``fit`` starts from.
        examples_per_step: examples in one batch (for ``epoch``).
        records: examples in one epoch, or ``None``.
    """

    def __init__(
        self,
        run_dir: Path | None,
        callback: Callable[[dict[str, Any]], None] | None,
        progress: bool | None,
        *,
        steps: int,
        start: int,
        examples_per_step: int,
        records: int | None,
    ) -> None:
        self._file: JsonLines | None = None
        if run_dir is not None and jax.process_index() == 0:
            run_dir.mkdir(parents=True, exist_ok=True)
            # Records are cleaned to finite numbers or None first (_number), so no NaN reaches it.
            self._file = JsonLines(run_dir / "metrics.jsonl", allow_nan=False)
        self._callback = callback
        self._pending: list[Mapping[str, jax.Array]] = []
        self._examples = examples_per_step
        self._records = records
        self._started = self._mark = time.perf_counter()
        self._progress: Progress | None = None
        console = Console(stderr=True)
        show = progress if progress is not None else (console.is_terminal or console.is_jupyter)
        if show and jax.process_index() == 0:
            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"),
                TextColumn("{task.fields[tps]} tok/s"),
                TimeRemainingColumn(),
                console=console,
            )
            self._task = self._progress.add_task(
                "train", total=steps, completed=start, loss="-", tps="-"
            )
            self._progress.start()

    def add(self, metrics: Mapping[str, jax.Array]) -> None:
        """Keep one step's metrics (device arrays; nothing is fetched here)."""
        self._pending.append(metrics)
        if self._progress is not None:
            self._progress.advance(self._task)

    def flush(self, step: int, updates: int, skipped: int) -> dict[str, Any] | None:
        """Write the record for the steps added since the last flush."""
        if not self._pending:
            return None
        now = time.perf_counter()
        seconds = now - self._mark
        self._mark = now
        steps = jax.device_get(self._pending)  # the one sync point per record
        self._pending = []
        finite = [s for s in steps if bool(s.get("finite", True))]
        record: dict[str, Any] = {"step": step, "updates": updates}
        names = dict.fromkeys(name for s in finite for name in s if name not in _FLAGS)
        for name in names:
            values = [float(s[name]) for s in finite if name in s]
            record[name] = float(np.sum(values)) if name == "tokens" else float(np.mean(values))
        if "tokens" in record:
            record["tokens_per_s"] = record["tokens"] / seconds if seconds > 0 else None
        record["seconds"] = seconds
        record["elapsed"] = now - self._started
        if self._records:
            record["epoch"] = step * self._examples / self._records
        record["skipped_nonfinite"] = skipped
        self.write(record)
        if self._progress is not None:
            loss = record.get("loss")
            tps = record.get("tokens_per_s")
            self._progress.update(
                self._task,
                loss="-" if loss is None else f"{loss:.4f}",
                tps="-" if tps is None else f"{tps:,.0f}",
            )
        return record

    def write(self, record: Mapping[str, Any]) -> None:
        """Append ``record`` to metrics.jsonl and hand it to the callback."""
        clean = {name: _number(value) for name, value in record.items()}
        if self._file is not None:
            self._file.write(clean)
        if self._callback is not None:
            self._callback(clean)

    def close(self) -> None:
        """Stop the progress bar and close the metrics file."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self._file is not None:
            self._file.close()
            self._file = None
