"""Progress display of a run: a rich live view on a terminal, short periodic lines otherwise.

It shows whatever it is fed: flow snapshots (per stage items/s and busy share, per edge
depth against capacity and wait seconds), progress counters (``progress``) and latest
scalar values (``values``). Updates may come from any thread.

The terminal view shows all of it. Off a terminal (a log file, CI) a line every
``interval`` seconds says only what is current, so a person reads it at a glance::

    [  42.0s] arithmetic | GRPO updates 120/1000 3.1/s | loss=0.0123 reward=0.81 lag=1 | busiest update 93%

* progress: the counters advanced since the previous line (the current phase; a finished
  phase's counter drops out), with their rate over that interval;
* values: those set since the previous line, each once with its latest value (a figure that
  stopped changing, such as the previous phase's last probe, is not repeated);
* flow: the one busiest stage over the interval. Per-stage and per-queue counters go to
  ``metrics.jsonl`` (the run's ``flow`` records) and the terminal view, not into the line.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from dew_pipe.flow.metrics import FlowSnapshot


def _label(edge: str) -> str:
    """Shorter edge name for the display: default port names ("out", "in") left out."""
    src, _, dst = edge.partition("->")
    src = src.removesuffix(".out")
    dst = dst.removesuffix(".in")
    return f"{src}->{dst}"


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


class Display:
    """Live or line-by-line progress, chosen by whether the console is a terminal.

    Args:
      console: where to draw; default stdout.
      live: force the live view on (True) or off (False); default: when a terminal.
      interval: seconds between plain lines (the live view refreshes 4 times a second).
      title: shown at the top of the live view and at the start of plain lines.

    Example:
      >>> import io
      >>> out = io.StringIO()
      >>> with Display(Console(file=out), live=False, interval=0) as d:
      ...     d.values(loss=0.25)
      >>> "loss=0.25" in out.getvalue()
      True
    """

    def __init__(
        self,
        console: Console | None = None,
        *,
        live: bool | None = None,
        interval: float = 5.0,
        title: str = "",
    ) -> None:
        self.console = console or Console()
        self.live = self.console.is_terminal if live is None else live
        self.interval = interval
        self.title = title
        self._lock = threading.Lock()
        self._start = time.monotonic()
        self._last_line = self._start
        self._progress: dict[str, tuple[float, float | None, float]] = {}
        self._values: dict[str, Any] = {}
        self._snapshot: FlowSnapshot | None = None
        self._rates: dict[str, float] = {}
        self._previous: tuple[float, dict[str, int]] | None = None
        self._live: Live | None = None
        # What the previous plain line saw, so the next one shows only what changed since.
        self._fresh_progress: dict[str, None] = {}  # labels advanced since, in order
        self._fresh_values: dict[str, Any] = {}  # values set since (latest of each)
        self._progress_mark: dict[str, tuple[float, float]] = {}  # label -> (done, time)
        self._latest_progress: str | None = None
        self._busy_mark: tuple[float, dict[str, float]] | None = None  # (elapsed, busy_s)
        self._holds = 0  # open held() blocks

    # ------------------------------------------------------------------ feeding

    def print(self, message: str) -> None:
        """A line that stays (above the live view on a terminal)."""
        self.console.print(message, markup=False, highlight=False, soft_wrap=True)

    def progress(self, label: str, done: float, total: float | None = None) -> None:
        """Set a progress counter (``done`` of ``total``; rate shown per second)."""
        with self._lock:
            now = time.monotonic()
            first = self._progress.get(label, (done, total, now))[2]
            self._progress[label] = (done, total, first)
            self._progress_mark.setdefault(label, (done, now))
            self._fresh_progress[label] = None
            self._latest_progress = label
        self._tick()

    def values(self, **values: Any) -> None:
        """Set the latest scalar values (loss, reward, accuracy, ...)."""
        with self._lock:
            self._values.update(values)
            self._fresh_values.update(values)
        self._tick()

    def flow(self, snapshot: FlowSnapshot) -> None:
        """Show a flow snapshot; rates are computed against the previous one."""
        with self._lock:
            counts = {n: s.items_in or s.items_out for n, s in snapshot.stages.items()}
            if self._previous is not None:
                t0, before = self._previous
                dt = max(snapshot.elapsed_s - t0, 1e-9)
                self._rates = {n: (c - before.get(n, 0)) / dt for n, c in counts.items()}
            else:
                self._rates = {n: c / max(snapshot.elapsed_s, 1e-9) for n, c in counts.items()}
            self._previous = (snapshot.elapsed_s, counts)
            self._snapshot = snapshot
        self._tick()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Feed several updates as one: no plain line is printed until the block ends.

        A step's progress and its values then always reach a line together.

        Example:
          >>> import io
          >>> display = Display(Console(file=io.StringIO()), live=False, interval=0)
          >>> with display.held():
          ...     display.progress("steps", 10, 100)
          ...     display.values(loss=0.5)
          >>> "steps 10/100" in display.console.file.getvalue().splitlines()[0]
          True
        """
        with self._lock:
            self._holds += 1
        try:
            yield
        finally:
            with self._lock:
                self._holds -= 1
            self._tick()

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> Display:
        if self.live:
            self._live = Live(self, console=self.console, refresh_per_second=4, transient=False)
            self._live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the live view (its last frame stays), or print a final summary line."""
        if self._live is not None:
            self._live.refresh()
            self._live.stop()
            self._live = None
        elif not self.live:
            self._emit()

    # ------------------------------------------------------------------ rendering

    def _tick(self) -> None:
        if self.live or self._holds:
            return  # the live view redraws itself; a held block prints when it ends
        now = time.monotonic()
        if now - self._last_line >= self.interval:
            self._last_line = now
            self._emit()

    def _emit(self) -> None:
        """Print the plain line and start the next interval from what it showed."""
        text = self.line()
        with self._lock:
            now = time.monotonic()
            self._progress_mark = {k: (v[0], now) for k, v in self._progress.items()}
            self._fresh_progress.clear()
            self._fresh_values.clear()
            if self._snapshot is not None:
                busy = {n: st.busy_s for n, st in self._snapshot.stages.items()}
                self._busy_mark = (self._snapshot.elapsed_s, busy)
        self.console.print(text, markup=False, highlight=False, soft_wrap=True)

    def line(self) -> str:
        """The plain line: elapsed time, title, and what changed since the previous line.

        See the module docstring: the progress counters advanced since then (or, if none
        was, the last one advanced) with their rate over the interval, the values set since
        then, and the busiest stage of the flow over the interval.
        """
        with self._lock:
            now = time.monotonic()
            head = f"[{now - self._start:7.1f}s]{' ' + self.title if self.title else ''}"
            parts = [head]
            labels = list(self._fresh_progress)
            if not labels and self._latest_progress is not None:
                labels = [self._latest_progress]
            counters = []
            for label in labels:
                done, total, _ = self._progress[label]
                text = f"{label} {_fmt(done)}{'/' + _fmt(total) if total else ''}"
                if label in self._fresh_progress:
                    before, since = self._progress_mark.get(label, (done, now))
                    text += f" {(done - before) / max(now - since, 1e-9):.3g}/s"
                counters.append(text)
            if counters:
                parts.append(", ".join(counters))
            if self._fresh_values:
                parts.append(" ".join(f"{k}={_fmt(v)}" for k, v in self._fresh_values.items()))
            busiest = self._busiest()
            if busiest:
                parts.append(busiest)
        return " | ".join(parts)

    def _busiest(self) -> str:
        """``"busiest NAME 93%"``: the stage with the largest busy share since the last line."""
        snap = self._snapshot
        if snap is None or not snap.stages:
            return ""
        since, before = self._busy_mark or (0.0, {})
        span = snap.elapsed_s - since
        if span <= 0:
            return ""
        shares = {n: (st.busy_s - before.get(n, 0.0)) / span for n, st in snap.stages.items()}
        name = max(shares, key=shares.__getitem__)
        return f"busiest {name} {min(max(shares[name], 0.0), 1.0):.0%}"

    def __rich__(self) -> Group:
        with self._lock:
            blocks: list[Any] = []
            head = f"{self.title}  " if self.title else ""
            blocks.append(Text(f"{head}{time.monotonic() - self._start:.1f}s", style="bold"))
            if self._progress:
                t = Table("progress", "done", "total", "per s", box=None)
                for label, (done, total, first) in self._progress.items():
                    rate = done / max(time.monotonic() - first, 1e-9)
                    t.add_row(label, _fmt(done), _fmt(total) if total else "", f"{rate:.3g}")
                blocks.append(t)
            if self._values:
                t = Table("value", "latest", box=None)
                for k, v in self._values.items():
                    t.add_row(k, _fmt(v))
                blocks.append(t)
            if self._snapshot is not None:
                blocks += self._flow_tables(self._snapshot)
        return Group(*blocks)

    def _flow_tables(self, snap: FlowSnapshot) -> list[Table]:
        stages = Table("stage", "state", "in", "out", "items/s", "busy", box=None)
        for n, s in snap.stages.items():
            busy = s.busy_s / s.elapsed_s if s.elapsed_s > 0 else 0.0
            rate = self._rates.get(n, 0.0)
            stages.add_row(
                n, s.state, str(s.items_in), str(s.items_out), f"{rate:.3g}", f"{busy:.0%}"
            )
        edges = Table("queue", "depth", "max", "items", "wait put/get", "dropped", box=None)
        for column in edges.columns:
            column.no_wrap = True
        for e in snap.edges.values():
            shown = min(e.capacity, 8)  # a bar of at most 8 cells, scaled to the capacity
            filled = round(shown * e.depth / e.capacity)
            bar = "#" * filled + "." * (shown - filled)
            edges.add_row(
                _label(e.name) + (" (fb)" if e.feedback else ""),
                f"{bar} {e.depth}/{e.capacity}",
                str(e.max_depth),
                str(e.items),
                f"{e.put_wait_s:.1f}/{e.get_wait_s:.1f}s",
                str(e.dropped),
            )
        return [stages, edges]
