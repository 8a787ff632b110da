"""RunContext: what ``dew-pipe run`` hands a job that is not a flow pipeline.

A pipeline file's factory may return an object with a ``run(context)`` method instead of a
``Pipeline`` (a training job that drives the Trainer, for example). The context gives it the
run directory, the resolved settings, a metrics writer, the display, and the cancellation
event that Ctrl-C sets; a long job calls ``log``/``progress`` as it goes and returns (or
raises ``Cancelled``) soon after ``cancelled`` turns true.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dew_pipe.flow.display import Display
from dew_pipe.flow.metrics import FlowSnapshot, MetricsWriter
from dew_pipe.flow.pipeline import Pipeline


@dataclass
class RunContext:
    """The run directory, settings, metrics, display and cancellation of one run.

    Attributes:
      run_dir: folder for everything the run writes (``config.json`` and ``metrics.jsonl``
        are already there).
      config: the resolved settings the factory was called with.
      metrics: appends JSON lines to ``run_dir / "metrics.jsonl"``.
      display: the live view or periodic lines.
      cancel: set on Ctrl-C (or by whoever started the run); jobs poll it.

    Example:
      >>> import io, tempfile, threading
      >>> from rich.console import Console
      >>> d = Path(tempfile.mkdtemp())
      >>> ctx = RunContext(d, {}, MetricsWriter(d / "metrics.jsonl"),
      ...                  Display(Console(file=io.StringIO()), live=False), threading.Event())
      >>> ctx.log(step=1, loss=0.5)
      >>> '"loss": 0.5' in (d / "metrics.jsonl").read_text()
      True
    """

    run_dir: Path
    config: Mapping[str, Any]
    metrics: MetricsWriter
    display: Display
    cancel: threading.Event = field(default_factory=threading.Event)

    @property
    def cancelled(self) -> bool:
        """True once the run should stop."""
        return self.cancel.is_set()

    def log(self, step: int | None = None, **values: Any) -> None:
        """Record scalar values: a ``values`` line in metrics.jsonl, and on the display."""
        self.metrics.write("values", step=step, **values)
        self.display.values(**({"step": step} if step is not None else {}), **values)

    def progress(self, label: str, done: float, total: float | None = None) -> None:
        """Show progress (``done`` of ``total``) on the display."""
        self.display.progress(label, done, total)

    def print(self, message: str) -> None:
        """A line for the person watching, also kept as an ``event`` line in the metrics."""
        self.display.print(message)
        self.metrics.write("event", message=message)

    def run_pipeline(
        self, pipeline: Pipeline, *, timeout: float | None = None, metrics_every: float = 1.0
    ) -> FlowSnapshot:
        """Run a flow pipeline with this context's cancellation, metrics and display.

        Raises:
          as ``Pipeline.run``.
        """

        def on_metrics(snapshot: FlowSnapshot) -> None:
            self.metrics.flow(snapshot)
            self.display.flow(snapshot)

        return pipeline.run(
            timeout=timeout, cancel=self.cancel, on_metrics=on_metrics, metrics_every=metrics_every
        )
