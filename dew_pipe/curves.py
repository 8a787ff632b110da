"""Curves of any run from its ``metrics.jsonl``: loss, reward, accuracy, lag and queue waits.

Three writers put records into a run's ``metrics.jsonl`` and :func:`run_curves` reads all
of them:

* the Trainer's log (:mod:`dew_pipe.training.log`): records without a ``kind``, one per
  ``log_every`` steps (``step``, ``loss``, the objective's metrics, ``rollout/...``), and
  validation records (``val/...``);
* a job's own ``values`` records (``RunContext.log``: ``kind: "values"``, often with a
  ``phase`` such as ``"sft"`` or ``"grpo"``);
* the flow runtime's ``flow`` records: per edge the seconds producers waited on a full queue
  (``put_wait_s``) and consumers on an empty one (``get_wait_s``).

Each measure is a curve against ``step`` (against ``elapsed`` seconds where its records have
no step; queue waits always against seconds), one curve per run, phase and measure. A step
logged twice (a run resumed from a checkpoint logs the steps after it again) keeps its
last value. The measures and the panel each goes into are :data:`PANELS`.

:func:`plot_runs` draws them with matplotlib's Agg backend (no display needed): several runs
overlaid in one figure to compare them, or side by side, one column per run (the stages of a
chain). ``dew-pipe plot RUN_DIR...`` is this function; the embedded job's ``progress.png``
(:mod:`dew_pipe.tasks.plot`) reads its records with :func:`read_metrics` too.

Example:
    >>> import tempfile
    >>> run = Path(tempfile.mkdtemp())
    >>> _ = (run / "metrics.jsonl").write_text(
    ...     '{"step": 10, "loss": 2.0, "elapsed": 1.0}\\n{"step": 20, "loss": 1.5, "elapsed": 2.0}\\n')
    >>> [(c.panel, c.name, c.x.tolist(), c.y.tolist()) for c in run_curves(run)]
    [('loss', 'loss', [10.0, 20.0], [2.0, 1.5])]
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dew_pipe._files import write_atomic
from dew_pipe._jsonl import read_objects

__all__ = [
    "PANELS",
    "Curve",
    "metrics_path",
    "plot_runs",
    "read_metrics",
    "run_curves",
    "running_mean",
    "write_png",
]

METRICS = "metrics.jsonl"

PANELS: dict[str, tuple[str, ...]] = {
    "loss": ("loss", "val/loss"),
    "reward": (
        "reward",
        "reward/mean",
        "rollout/reward/mean",
        "sampled_reward",
        "rewards/margins",
    ),
    "accuracy": ("held_out", "accuracy", "val/accuracy", "rewards/accuracies", "exact_match"),
    "lag": ("lag", "version/lag_mean", "rollout/version/lag_mean", "version/lag_max"),
    "queue wait": (),  # from the flow records: seconds waited per edge, put + get
}
"""Panel -> the record fields drawn in it, in this order (queue waits come from ``flow``
records)."""

_PANEL_OF = {name: panel for panel, names in PANELS.items() for name in names}
_UNITS = {"queue wait": "seconds waited (cumulative)", "lag": "updates"}
_MOST_EDGES = 5  # queue-wait curves per run: the edges that waited longest
_NOISY = 20  # above this many points a curve is drawn faint with its running mean on top


@dataclass(frozen=True)
class Curve:
    """One measure of one run (and phase) over steps or seconds.

    Attributes:
        run: the run's label (its directory name unless given).
        panel: the panel it is drawn in, a key of :data:`PANELS`.
        name: the measure (``"loss"``, ``"rewards/margins"``; ``"A->B wait"`` for an edge).
        phase: the records' ``phase`` field, or None.
        x: float64 steps, or seconds when ``x_label`` is ``"seconds"``; increasing.
        y: float64 values, finite.
        x_label: ``"step"`` or ``"seconds"``.
    """

    run: str
    panel: str
    name: str
    phase: str | None
    x: np.ndarray
    y: np.ndarray
    x_label: str

    @property
    def label(self) -> str:
        """How the legend names it: the measure, its phase and, with several runs, the run."""
        return " ".join(p for p in (self.phase, self.name) if p)


def metrics_path(run: str | os.PathLike[str]) -> Path:
    """The ``metrics.jsonl`` of a run directory (or the path itself when it is a file).

    Raises:
        FileNotFoundError: neither a directory holding ``metrics.jsonl`` nor a file.

    Example:
        >>> metrics_path("/no/such/run")
        Traceback (most recent call last):
        ...
        FileNotFoundError: /no/such/run: no such run directory or metrics file; expected a run directory holding metrics.jsonl
    """
    path = Path(run)
    if path.is_dir():
        inside = path / METRICS
        if not inside.is_file():
            raise FileNotFoundError(
                f"{path}: no {METRICS} in this directory; expected a run directory written "
                "by dew-pipe run or Trainer(run_dir=...)"
            )
        return inside
    if path.is_file():
        return path
    raise FileNotFoundError(
        f"{path}: no such run directory or metrics file; expected a run directory holding {METRICS}"
    )


def read_metrics(run: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every record of a run's ``metrics.jsonl``, in file order (blank lines skipped).

    Args:
        run: a run directory, or a ``metrics.jsonl`` file.

    Raises:
        FileNotFoundError: as :func:`metrics_path`.
        ValueError: a line that is not a JSON object (naming the file and line), or a file
            without any record.
    """
    path = metrics_path(run)
    records = [record for _, record in read_objects(path)]
    if not records:
        raise ValueError(f"{path} is empty; expected the records of a run (was it started?)")
    return records


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _curve(run: str, panel: str, name: str, phase: str | None, points: list, x_label: str):
    last: dict[float, float] = {}
    for x, y in points:  # a step logged again (after a resume) keeps its last value
        last[x] = y
    xs = np.array(sorted(last), dtype=np.float64)
    ys = np.array([last[x] for x in xs], dtype=np.float64)
    return Curve(run, panel, name, phase, xs, ys, x_label)


def _value_curves(records: list[dict[str, Any]], run: str) -> list[Curve]:
    series: dict[tuple[str | None, str], list[dict[str, Any]]] = {}
    for record in records:
        if record.get("kind") not in (None, "values"):
            continue
        phase = record.get("phase") if isinstance(record.get("phase"), str) else None
        for name in record:
            if name in _PANEL_OF and _number(record[name]) is not None:
                series.setdefault((phase, name), []).append(record)
    curves = []
    for (phase, name), rows in series.items():
        by_step = all(_number(r.get("step")) is not None for r in rows)
        x_field = "step" if by_step else "elapsed"
        points = [
            (_number(r.get(x_field)), _number(r[name]))
            for r in rows
            if _number(r.get(x_field)) is not None
        ]
        if points:
            label = "step" if by_step else "seconds"
            curves.append(_curve(run, _PANEL_OF[name], name, phase, points, label))
    order = {name: i for i, name in enumerate(_PANEL_OF)}
    return sorted(curves, key=lambda c: (order[c.name], c.phase or ""))


def _edge(name: str) -> str:
    src, _, dst = name.partition("->")
    return f"{src.removesuffix('.out')}->{dst.removesuffix('.in')}"


def _wait_curves(records: list[dict[str, Any]], run: str) -> list[Curve]:
    waits: dict[str, list[tuple[float, float]]] = {}
    for record in records:
        if record.get("kind") != "flow" or not isinstance(record.get("edges"), Mapping):
            continue
        elapsed = _number(record.get("elapsed_s", record.get("elapsed")))
        if elapsed is None:
            continue
        for name, edge in record["edges"].items():
            if not isinstance(edge, Mapping):
                continue
            put, get = _number(edge.get("put_wait_s")), _number(edge.get("get_wait_s"))
            if put is not None and get is not None:
                waits.setdefault(name, []).append((elapsed, put + get))
    longest = sorted(waits, key=lambda e: -waits[e][-1][1])[:_MOST_EDGES]
    return [
        _curve(run, "queue wait", f"{_edge(name)} wait", None, waits[name], "seconds")
        for name in longest
    ]


def run_curves(run: str | os.PathLike[str], label: str | None = None) -> list[Curve]:
    """The curves of one run, in the order of :data:`PANELS`.

    Args:
        run: a run directory, or a ``metrics.jsonl`` file.
        label: how the run is named in the figure; default its directory's name.

    Raises:
        FileNotFoundError, ValueError: as :func:`read_metrics`.
    """
    path = metrics_path(run)
    records = read_metrics(path)
    name = label if label is not None else (Path(run).name if Path(run).is_dir() else path.stem)
    curves = _value_curves(records, name) + _wait_curves(records, name)
    panels = list(PANELS)
    return sorted(curves, key=lambda c: panels.index(c.panel))


def running_mean(values: np.ndarray, window: int) -> np.ndarray:
    """Mean of each value and the ``window - 1`` before it (fewer at the start).

    Example:
        >>> running_mean(np.array([1.0, 3.0, 5.0]), 2).tolist()
        [1.0, 2.0, 4.0]
    """
    if values.size == 0:
        return values
    kernel = np.ones(min(window, values.size))
    sums = np.convolve(values, kernel, mode="full")[: values.size]
    counts = np.convolve(np.ones_like(values), kernel, mode="full")[: values.size]
    return sums / counts


def _draw(ax: Any, curve: Curve, color: Any, style: str, label: str) -> None:
    if curve.x.size > _NOISY and curve.panel in ("reward", "accuracy", "loss"):
        ax.plot(curve.x, curve.y, color=color, alpha=0.25, linewidth=0.8, linestyle=style)
        window = max(2, curve.x.size // 20)
        ax.plot(curve.x, running_mean(curve.y, window), color=color, linestyle=style, label=label)
    else:
        marker = "o" if curve.x.size <= 12 else None
        ax.plot(curve.x, curve.y, color=color, linestyle=style, marker=marker, markersize=3,
                label=label)  # fmt: skip


def _panel(ax: Any, panel: str, curves: list[Curve], runs: list[str], title: str) -> None:
    import matplotlib.pyplot as plt

    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    names = list(dict.fromkeys(c.label for c in curves))
    styles = ("-", "--", ":", "-.")
    for curve in curves:
        several = len(runs) > 1
        color_key = runs.index(curve.run) if several else names.index(curve.label)
        style = styles[names.index(curve.label) % len(styles)] if several else "-"
        label = f"{curve.run}: {curve.label}" if several else curve.label
        _draw(ax, curve, colors[color_key % len(colors)], style, label)
    labels = sorted({c.x_label for c in curves})
    ax.set_xlabel(" / ".join(labels))
    ax.set_ylabel(_UNITS.get(panel, panel))
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")


def write_png(fig: Any, out: str | os.PathLike[str]) -> Path:
    """Save a matplotlib figure as the PNG ``out``, whole or not at all
    (:func:`dew_pipe._files.write_atomic`).

    Raises:
        FileNotFoundError: ``out``'s folder does not exist.
    """
    return write_atomic(out, lambda path: fig.savefig(path, format="png"))


def plot_runs(
    runs: Sequence[str | os.PathLike[str]],
    out: str | os.PathLike[str],
    *,
    side_by_side: bool = False,
    labels: Sequence[str] | None = None,
) -> Path:
    """Draw the curves of ``runs`` into the PNG ``out``.

    Args:
        runs: run directories (or ``metrics.jsonl`` files).
        out: the PNG to write; its folder must exist. It appears whole (written under a
            temporary name, then renamed).
        side_by_side: one column per run (a chain's stages), instead of all runs overlaid
            in each panel.
        labels: names of the runs in the figure; default their directory names.

    Returns:
        ``out`` as a Path.

    Raises:
        FileNotFoundError: a run without ``metrics.jsonl``, or ``out``'s folder missing.
        ValueError: a malformed or empty metrics file (naming it), no runs, labels that do
            not match the runs, or runs with nothing to draw.
    """
    if isinstance(runs, str | os.PathLike):
        raise TypeError(f"runs is the one path {runs!r}; expected a sequence of run directories")
    if not runs:
        raise ValueError("runs is empty; expected at least one run directory")
    if labels is not None and len(labels) != len(runs):
        raise ValueError(f"labels has {len(labels)} names for {len(runs)} runs; expected one each")
    names = list(labels) if labels is not None else [None] * len(runs)
    per_run = [run_curves(run, name) for run, name in zip(runs, names, strict=True)]
    empty = [str(run) for run, curves in zip(runs, per_run, strict=True) if not curves]
    if empty:
        raise ValueError(
            f"{', '.join(empty)}: no {', '.join(PANELS)} records to plot; expected training "
            "records (loss, reward...), values records or flow records"
        )
    runs_named = [curves[0].run for curves in per_run]
    panels = [p for p in PANELS if any(c.panel == p for curves in per_run for c in curves)]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if side_by_side:
        rows, cols = len(panels), len(per_run)
    else:
        cols = 1 if len(panels) == 1 else 2
        rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 3.6 * rows), dpi=100, squeeze=False)
    for ax in axes.flat:
        ax.set_visible(False)
    for row, panel in enumerate(panels):
        if side_by_side:
            for col, curves in enumerate(per_run):
                mine = [c for c in curves if c.panel == panel]
                if mine:
                    ax = axes[row][col]
                    ax.set_visible(True)
                    _panel(ax, panel, mine, [runs_named[col]], f"{runs_named[col]}: {panel}")
        else:
            ax = axes[row // cols][row % cols]
            ax.set_visible(True)
            mine = [c for curves in per_run for c in curves if c.panel == panel]
            _panel(ax, panel, mine, runs_named, panel)
    fig.tight_layout()
    try:
        return write_png(fig, out)
    finally:
        plt.close(fig)
