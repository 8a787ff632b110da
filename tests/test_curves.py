"""Curves of runs (dew_pipe.curves) and ``dew-pipe plot``: on run directories written by a
real Trainer and a real ``dew-pipe run``, several runs overlaid or side by side, a resumed
run's repeated steps, and the files it cannot draw."""

from __future__ import annotations

import doctest
import json

import jax
import numpy as np
import optax
import pytest
from trainer_helpers import MaskedRegression, cycling, make_batch

from dew_pipe import Trainer, curves
from dew_pipe.cli import main
from dew_pipe.curves import plot_runs, read_metrics, run_curves

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    """Two real Trainer runs (different learning rates) writing metrics.jsonl."""
    base = tmp_path_factory.mktemp("trainer")
    data = cycling([make_batch(seed) for seed in range(4)])
    runs = []
    for name, rate in (("fast", 0.1), ("slow", 0.01)):
        trainer = Trainer(
            MaskedRegression(), optax.sgd(rate), key=jax.random.key(0), run_dir=base / name,
            progress=False,
        )  # fmt: skip
        trainer.fit(data, steps=12, log_every=2)
        runs.append(base / name)
    return runs


@pytest.fixture(scope="module")
def flow_run(tmp_path_factory):
    """A real `dew-pipe run` of the demo pipeline: flow records with queue waits."""
    run = tmp_path_factory.mktemp("flow") / "demo"
    assert main(["run", "pipelines/demo.py", "--run-dir", str(run), "--metrics-every", "0.2"]) == 0
    return run


def test_curves_of_a_trainer_run_are_its_records(trainer_runs):
    run = trainer_runs[0]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    (loss,) = run_curves(run)
    assert (loss.panel, loss.name, loss.x_label, loss.run) == ("loss", "loss", "step", "fast")
    assert loss.x.tolist() == [r["step"] for r in records] == list(range(2, 13, 2))
    assert loss.y.tolist() == [r["loss"] for r in records]


def test_queue_waits_come_from_flow_records(flow_run):
    waits = [c for c in run_curves(flow_run) if c.panel == "queue wait"]
    assert waits and all(c.x_label == "seconds" for c in waits)
    last = [json.loads(line) for line in (flow_run / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in last if r.get("kind") == "flow"][-1]
    totals = {
        curves._edge(name): e["put_wait_s"] + e["get_wait_s"] for name, e in last["edges"].items()
    }
    for curve in waits:  # the cumulative waits end where the last flow record says
        assert curve.y[-1] == pytest.approx(totals[curve.name.removesuffix(" wait")])
    assert len(waits) == min(5, len(totals))
    ranked = sorted(totals.values(), reverse=True)[: len(waits)]
    assert sorted((c.y[-1] for c in waits), reverse=True) == pytest.approx(ranked)


def test_cli_plot_overlays_runs_and_draws_side_by_side(trainer_runs, flow_run, tmp_path, capsys):
    assert main(["plot", str(trainer_runs[0])]) == 0
    single = trainer_runs[0] / "curves.png"
    assert single.read_bytes().startswith(PNG) and "wrote" in capsys.readouterr().out
    out = tmp_path / "both.png"
    assert main(["plot", *map(str, trainer_runs), str(flow_run), "--output", str(out)]) == 0
    overlaid = out.read_bytes()
    assert overlaid.startswith(PNG)
    side = tmp_path / "side.png"
    assert main(["plot", *map(str, trainer_runs), "--side-by-side", "--output", str(side)]) == 0
    import matplotlib.image

    wide, tall = matplotlib.image.imread(side), matplotlib.image.imread(out)
    assert wide.shape[1] > wide.shape[0]  # two columns, one row (loss)
    assert tall.shape[0] == 360 and tall.shape[1] == 1100  # two panels: loss, queue wait
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp PNG


def test_a_resumed_run_keeps_the_last_value_of_a_step(tmp_path):
    lines = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0}, {"step": 2, "loss": 1.9},
             {"step": 3, "loss": 1.0}, {"kind": "values", "phase": "grpo", "step": 1,
             "reward": 0.5}, {"kind": "values", "phase": "grpo", "step": 2, "reward": 0.75}]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\n")
    loss, reward = run_curves(tmp_path, label="r")
    assert loss.x.tolist() == [1, 2, 3] and loss.y.tolist() == [3.0, 1.9, 1.0]
    assert (reward.phase, reward.label, reward.y.tolist()) == ("grpo", "grpo reward", [0.5, 0.75])


def test_values_without_steps_are_drawn_against_seconds(tmp_path):
    lines = [{"kind": "values", "elapsed": 1.5, "accuracy": 0.25},
             {"kind": "values", "elapsed": 3.0, "accuracy": 0.5, "step": None}]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\n")
    (accuracy,) = run_curves(tmp_path)
    assert accuracy.x_label == "seconds" and accuracy.x.tolist() == [1.5, 3.0]


def test_files_plot_cannot_draw_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no metrics.jsonl in this directory"):
        plot_runs([tmp_path], tmp_path / "x.png")
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="metrics.jsonl is empty"):
        read_metrics(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n{"step": 2,\n')
    with pytest.raises(ValueError, match="metrics.jsonl line 2 is not JSON"):
        plot_runs([tmp_path], tmp_path / "x.png")
    (tmp_path / "metrics.jsonl").write_text('{"kind": "event", "message": "hello"}\n')
    with pytest.raises(ValueError, match="no loss, reward, accuracy, lag, queue wait records"):
        plot_runs([tmp_path], tmp_path / "x.png")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    with pytest.raises(FileNotFoundError, match="does not exist"):
        plot_runs([tmp_path], tmp_path / "missing" / "x.png")
    with pytest.raises(TypeError, match="expected a sequence of run directories"):
        plot_runs(str(tmp_path), tmp_path / "x.png")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_nan_and_non_numbers_are_left_out_of_a_curve(tmp_path):
    lines = ['{"step": 1, "loss": NaN}', '{"step": 2, "loss": "x"}', '{"step": 3, "loss": 0.5}']
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (loss,) = run_curves(tmp_path)
    assert loss.x.tolist() == [3.0] and np.isfinite(loss.y).all()


def test_docstring_examples_run():
    result = doctest.testmod(curves)
    assert result.attempted > 0 and result.failed == 0
