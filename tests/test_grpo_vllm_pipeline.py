"""pipelines/grpo_vllm.py: asynchronous GRPO with rollouts from the real vLLM of the session
fixture (tests/vllm_helpers.py), the weights pushed back after every update."""

from __future__ import annotations

import json
import math
import socket
from pathlib import Path

import pytest

from dew_pipe.cli import main
from dew_pipe.inference import JSONClient

PIPELINE = Path(__file__).resolve().parents[1] / "pipelines" / "grpo_vllm.py"
pytestmark = pytest.mark.slow


def test_trains_against_vllm_and_pushes_every_update(vllm_engine, tmp_path, capsys):
    engine = vllm_engine
    settings = [
        f"engine={engine.url}", f"checkpoint={engine.directory}", "steps=4", "prompts=4",
        "groups=4", "digits=3", "eval_every=2", "test_size=50",
    ]  # fmt: skip
    try:
        code = main(
            ["run", str(PIPELINE), "--run-dir", str(tmp_path)]
            + [part for s in settings for part in ("--set", s)]
        )
        out, err = capsys.readouterr()
        assert code == 0, err
        info = JSONClient(engine.url).get("/weight_info")
    finally:
        engine.restore()
    summary = json.loads((tmp_path / "summary.json").read_text())
    curve = summary["curve"]
    assert [row["update"] for row in curve] == [1, 2, 3, 4]
    assert summary["served_version"] == 4 and info == {"weight_version": "4"}
    for row in curve:
        assert math.isfinite(row["mismatch/kl"]) and 0 < row["mismatch/ess"] <= 1.0 + 1e-6
    # The first batch was drawn from the launch weights the trainer starts from: engine and
    # trainer agree up to float rounding. Later ones lag and come from bfloat16 pushes.
    assert abs(curve[0]["mismatch/kl"]) < 1e-3 and curve[0]["mismatch/ess"] > 0.99
    assert all(0 <= row["reward"] <= 1 and row["lag"] <= 1 for row in curve)
    assert all(row["push_s"] > 0 for row in curve[1:])  # the last push before each update
    assert "held_out" in curve[1] and "held_out" in curve[3]
    for step in range(1, 5):
        assert f"update {step:3d}: reward" in out
    assert "mismatch/kl" in out and "vLLM serves version 4" in out


def test_first_run_writes_the_checkpoint_and_says_how_to_start_vllm(tmp_path, capsys):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens there once the block ends
    checkpoint = tmp_path / "model"
    code = main([
        "run", str(PIPELINE), "--run-dir", str(tmp_path / "run"),
        "--set", f"engine=http://127.0.0.1:{port}", "--set", f"checkpoint={checkpoint}",
        "--set", "sft_steps=2", "--set", "test_size=20",
    ])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 1
    assert f"no vLLM server answers at http://127.0.0.1:{port}" in err
    assert f"--model {checkpoint.resolve()}" in err and f"--port {port}" in err
    assert "checkpoint written to" in out
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (checkpoint / name).is_file()
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["head_dim"] >= 32 and config["torch_dtype"] == "bfloat16"


def test_an_engine_serving_another_checkpoint_is_refused(vllm_engine, tmp_path, capsys):
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text("{}")
    code = main([
        "run", str(PIPELINE), "--run-dir", str(tmp_path / "run"),
        "--set", f"engine={vllm_engine.url}", "--set", f"checkpoint={other}",
    ])  # fmt: skip
    assert code == 1
    assert f"serves {vllm_engine.directory}, not the checkpoint" in capsys.readouterr().err
