"""pipelines/grpo_async.py: the scheduler's stages declared in a pipeline file and run by
`dew-pipe run`, training a tiny decoder on the toy task end to end."""

import json
from pathlib import Path

import pytest

from dew_pipe.cli import main

PIPELINE = Path(__file__).resolve().parents[1] / "pipelines" / "grpo_async.py"


@pytest.mark.slow
def test_dew_pipe_run_trains_the_toy_task_through_the_stages(tmp_path, capsys):
    code = main(["run", str(PIPELINE), "--run-dir", str(tmp_path), "--set", "steps=20"])
    assert code == 0, capsys.readouterr().err
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    values = [line for line in lines if line["kind"] == "values"]
    assert [v["step"] for v in values] == list(range(1, 21))
    assert all(v["lag"] is not None and v["lag"] <= 1 for v in values)
    rewards = [v["reward"] for v in values]
    assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4 + 0.3  # it learns the target id
    flows = [line for line in lines if line["kind"] == "flow"]
    assert set(flows[-1]["stages"]) == {"tasks", "rollout", "reward", "pack", "rescore", "update"}
    assert all(s["state"] == "done" for s in flows[-1]["stages"].values())
    assert json.loads((tmp_path / "config.json").read_text())["steps"] == 20
    assert json.loads((tmp_path / "run.json").read_text())["status"] == "done"


def test_dry_run_shows_the_graph_with_its_feedback_edges(capsys):
    assert main(["run", str(PIPELINE), "--dry-run", "--set", "steps=2"]) == 0
    out = capsys.readouterr().out
    for edge in (
        "pack.orders->rollout.orders (capacity 27, feedback)",
        "update.handover->rollout.handover (capacity 4, feedback)",
        "update.handover->pack.handover (capacity 4, feedback)",
        "update.params->rescore.params (capacity 2, feedback)",
    ):
        assert edge in out


def test_a_lag_bound_below_what_the_schedule_allows_is_refused(capsys):
    assert main(["run", str(PIPELINE), "--dry-run", "--set", "ahead=2"]) != 0
    expected = (
        "max_lag is 1 with ahead=2 and sync_every=1; expected at least ahead + sync_every - 1 = 2"
    )
    assert expected in capsys.readouterr().err
