"""pipelines/flow_grpo.py: flow-matching pretraining then Flow-GRPO, run by `dew-pipe run`."""

import json
from pathlib import Path

import numpy as np
import pytest

from dew_pipe.cli import load_file, main

PIPELINE = Path(__file__).resolve().parents[1] / "pipelines" / "flow_grpo.py"


def _module():
    return load_file(PIPELINE)


def test_generated_shapes_and_the_colour_reward():
    module = _module()
    images = module.shapes(np.random.default_rng(0), 300, 8)
    assert images.shape == (300, 8, 8, 3) and images.dtype == np.uint8
    lit = images.reshape(300, -1, 3).max(axis=1) == 255
    assert (lit.sum(axis=1) == 1).all()  # one colour per picture
    assert (lit.mean(axis=0) > 0.2).all()  # every colour appears
    reward = module.colour_reward("green")
    unit = images.astype(np.float64) / 127.5 - 1.0
    scores = reward(unit, {})
    green = lit[:, 1]
    np.testing.assert_array_equal(scores[green], 1.0)  # a green shape
    np.testing.assert_array_equal(scores[~green], -1.0)  # a shape of another colour
    # neither brightness nor colour alone wins: white, black, a picture flooded with green
    flooded = -np.ones((8, 8, 3))
    flooded[..., 1] = 1.0
    np.testing.assert_allclose(
        reward(np.stack([np.ones((8, 8, 3)), -np.ones((8, 8, 3)), flooded]), {}), [-1.5, 0, -0.5]
    )
    picture = module.grid(unit[:5])
    assert picture.shape == (3 * 9 + 1, 2 * 9 + 1, 3)


def test_dry_run_lists_the_settings_and_bad_ones_are_refused(capsys):
    assert main(["run", str(PIPELINE), "--dry-run", "--set", "target=blue"]) == 0
    out = capsys.readouterr().out
    assert '"target": "blue"' in out and "FlowGRPOJob(" in out
    assert main(["run", str(PIPELINE), "--dry-run", "--set", "size=7"]) != 0
    assert "size (7) is not a multiple of patch_size (2)" in capsys.readouterr().err


@pytest.mark.slow
def test_dew_pipe_run_writes_samples_reward_curve_and_summary(tmp_path, capsys):
    code = main(
        [
            "run", str(PIPELINE), "--run-dir", str(tmp_path),
            "--set", "size=4", "--set", "pretrain_steps=10", "--set", "grpo_steps=3",
            "--set", "preview=4", "--set", "emb_features=8", "--set", "num_layers=1",
            "--set", "num_heads=2", "--set", "beta=0.01",
        ]
    )  # fmt: skip
    assert code == 0, capsys.readouterr().err
    for name in ("samples_before.png", "samples_after.png", "reward.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert len(summary["rewards"]) == 3 and summary["pretrain_loss"] > 0
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    phases = [line.get("phase") for line in lines if line["kind"] == "values"]
    assert phases.count("grpo") == 3 and phases[-1] == "final" and "pretrain" in phases
    grpo = [line for line in lines if line.get("phase") == "grpo"]
    assert [line["reward_mean"] for line in grpo] == summary["rewards"]
    assert all(line["kl"] >= 0 for line in grpo)  # beta > 0: the KL against the pretrained model
