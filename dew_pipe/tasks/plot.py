"""A PNG of an arithmetic job's reward and held-out accuracy, drawn from its ``metrics.jsonl``.

:func:`plot_run` reads the ``values`` records that the embedded job
(``pipelines/arithmetic.py``) writes (each with a ``phase``: "sft", "grpo", "final") and
draws two panels with matplotlib's Agg backend (no display needed):

* over the run's wall time: held-out greedy exact match at every probe, the sampled reward
  (SFT probes: completions of training problems at the sampling temperature; GRPO: the mean
  reward of each training batch, and its running mean), with the SFT and GRPO phases shaded;
* over GRPO updates: the batch reward and held-out exact match, the part GRPO changed.

Any run directory can be drawn again: ``plot_run(run_dir / "metrics.jsonl", "out.png")``.
``measure`` names what ``held_out`` measures in the labels (the RLVR job,
``pipelines/rlvr.py``, passes ``"held-out pass rate"``).
It reads the file and smooths the batch reward with the helpers of :mod:`dew_pipe.curves`,
which draws any run's curves (``dew-pipe plot``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from dew_pipe.curves import read_metrics, running_mean, write_png

__all__ = ["plot_run", "read_values"]

_LABEL = {"boxstyle": "round,pad=0.2", "facecolor": "white", "edgecolor": "none", "alpha": 0.85}


def read_values(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The ``values`` records of a ``metrics.jsonl`` that carry a ``phase``, in file order.

    The file is read by :func:`dew_pipe.curves.read_metrics`, the reader of ``dew-pipe plot``.

    Raises:
      FileNotFoundError: no such file.
      ValueError: a line that is not a JSON object (naming the line), or an empty file.

    Example:
      >>> import tempfile
      >>> p = Path(tempfile.mkdtemp()) / "m.jsonl"
      >>> _ = p.write_text('{"kind": "values", "phase": "sft", "step": 1, "loss": 2.0}\\n'
      ...                  '{"kind": "flow", "stages": {}}\\n')
      >>> [r["loss"] for r in read_values(p)]
      [2.0]
    """
    return [r for r in read_metrics(path) if r.get("kind") == "values" and "phase" in r]


def _series(records: list[Mapping[str, Any]], phase: str, name: str, x: str) -> np.ndarray:
    """``[[x, value], ...]`` of one measure in one phase (records without it skipped)."""
    rows = [
        (float(r[x]), float(r[name]))
        for r in records
        if r.get("phase") == phase and isinstance(r.get(name), int | float) and x in r
    ]
    rows = [row for row in rows if math.isfinite(row[1])]
    return np.array(rows, dtype=np.float64).reshape(-1, 2)


def plot_run(
    metrics: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    measure: str = "held-out exact match",
) -> Path:
    """Draw the job's reward and held-out accuracy into the PNG ``out``.

    Args:
      metrics: the run's ``metrics.jsonl``.
      out: the PNG to write (its folder must exist).
      measure: what the ``held_out`` values are, as the labels name them.

    Returns:
      ``out`` as a Path.

    Raises:
      ValueError: the file holds no SFT or GRPO records (not an arithmetic job's run).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_values(metrics)
    phases = {r["phase"] for r in records}
    if not phases & {"sft", "grpo"}:
        raise ValueError(f"{metrics}: no values records of phase 'sft' or 'grpo' to plot")
    fig, (timeline, grpo) = plt.subplots(2, 1, figsize=(10, 8), dpi=100)
    _timeline(timeline, records, measure)
    _grpo_panel(grpo, records, measure)
    fig.tight_layout()
    try:
        return write_png(fig, out)
    finally:
        plt.close(fig)


def _timeline(ax: Any, records: list[Mapping[str, Any]], measure: str) -> None:
    colors = {"sft": "#dbe9f6", "grpo": "#fde4cf"}
    for phase, label in (("sft", "SFT"), ("grpo", "GRPO")):
        times = [float(r["elapsed"]) for r in records if r["phase"] == phase and "elapsed" in r]
        if times:
            ax.axvspan(min(times), max(times), color=colors[phase], zorder=0)
            ax.text(
                (min(times) + max(times)) / 2, 101.5, label, ha="center", va="bottom",
                fontsize=10, fontweight="bold",
            )  # fmt: skip
    held = np.concatenate(
        [_series(records, p, "held_out", "elapsed") for p in ("sft", "grpo")]
    ).reshape(-1, 2)
    ax.plot(held[:, 0], 100 * held[:, 1], "o-", color="#1f4e9a", label=measure)
    probes = _series(records, "sft", "sampled_reward", "elapsed")
    probes_g = _series(records, "grpo", "sampled_reward", "elapsed")
    both = np.concatenate([probes, probes_g]).reshape(-1, 2)
    ax.plot(
        both[:, 0], 100 * both[:, 1], "s--", color="#2e8b57", markersize=4,
        label="sampled reward (probe on training problems)",
    )  # fmt: skip
    batch = _series(records, "grpo", "reward", "elapsed")
    if batch.size:
        ax.plot(batch[:, 0], 100 * batch[:, 1], color="#e07b39", alpha=0.35, linewidth=0.8)
        ax.plot(
            batch[:, 0], 100 * running_mean(batch[:, 1], 10), color="#e07b39",
            label="GRPO batch reward (running mean of 10)",
        )  # fmt: skip
    if held.size:
        _mark_ends(ax, records, held)
    ax.set_xlabel("seconds since the run began")
    ax.set_ylabel("% of problems")
    ax.set_ylim(0, 108)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=9)
    ax.set_title(f"{measure} and sampled reward over the run")


def _mark_ends(ax: Any, records: list[Mapping[str, Any]], held: np.ndarray) -> None:
    final = [r for r in records if r["phase"] == "final"]
    if not final:
        return
    result = final[-1]
    sft_end = _series(records, "sft", "held_out", "elapsed")
    if sft_end.size and isinstance(result.get("before"), int | float):
        x, y = sft_end[-1]
        ax.annotate(
            f"before GRPO {100 * result['before']:.1f}%", (x, 100 * y), xytext=(8, -40),
            textcoords="offset points", ha="left", fontsize=9, bbox=_LABEL,
            arrowprops={"arrowstyle": "-", "color": "gray"},
        )  # fmt: skip
    if isinstance(result.get("after"), int | float):
        x, y = held[-1]
        ax.annotate(
            f"after GRPO {100 * result['after']:.1f}%", (x, 100 * y), xytext=(-10, -28),
            textcoords="offset points", ha="right", fontsize=9, bbox=_LABEL,
            arrowprops={"arrowstyle": "-", "color": "gray"},
        )  # fmt: skip


def _grpo_panel(ax: Any, records: list[Mapping[str, Any]], measure: str) -> None:
    batch = _series(records, "grpo", "reward", "step")
    held = _series(records, "grpo", "held_out", "step")
    if batch.size:
        ax.plot(batch[:, 0], 100 * batch[:, 1], color="#e07b39", alpha=0.35, linewidth=0.8)
        ax.plot(
            batch[:, 0], 100 * running_mean(batch[:, 1], 10), color="#e07b39",
            label="batch reward (running mean of 10)",
        )  # fmt: skip
    if held.size:
        ax.plot(held[:, 0], 100 * held[:, 1], "o-", color="#1f4e9a", label=measure)
    if not batch.size and not held.size:
        ax.text(0.5, 0.5, "no GRPO updates", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("GRPO update")
    ax.set_ylabel("% of problems")
    ax.grid(alpha=0.3)
    if batch.size or held.size:
        ax.legend(loc="lower right", fontsize=9)
    ax.set_title(f"GRPO: batch reward and {measure} per update")
