"""pipelines/chain.py through ``dew-pipe run``: a tiny SFT → DPO → GRPO chain run whole, and
the same chain stopped by Ctrl-C in SFT and by SIGKILL in DPO, then run again: finished
stages restore, the interrupted one resumes, and the final weights are bit-identical.

The child processes share a JAX persistent compilation cache (in the test's temporary
folder), so only the first one compiles; the others load the same executables.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from fault_helpers import ROOT

from dew_pipe.cli import main

TINY = {
    "digits": 1,
    "sft_steps": 120,
    "dpo_steps": 120,
    "grpo_steps": 4,
    "batch": 4,
    "groups": 2,
    "warmup": 5,
    "conversations": 200,
    "pairs": 64,
    "prompts": 32,
    "test_size": 20,
    "checkpoint_every": 10,
    "sample": 2,
}
DEADLINE_S = 900.0  # one run: a hang guard, generous for a 2-core machine under heavy load


def _command(output: Path, run_dir: Path) -> list[str]:
    sets = [f"--set={k}={v}" for k, v in {**TINY, "output": output}.items()]
    return [sys.executable, "-m", "dew_pipe.cli", "run", "pipelines/chain.py",
            "--run-dir", str(run_dir), *sets]  # fmt: skip


def _env(cache: Path) -> dict[str, str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(
        JAX_COMPILATION_CACHE_DIR=str(cache),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )
    return env


def _run(output: Path, run_dir: Path, cache: Path) -> subprocess.CompletedProcess:
    done = subprocess.run(_command(output, run_dir), cwd=ROOT, env=_env(cache),
                          capture_output=True, text=True, timeout=DEADLINE_S)  # fmt: skip
    return done


def _steps(stage_dir: Path) -> list[int]:
    folder = stage_dir / "checkpoints"
    return (
        sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.is_dir() else []
    )


def _interrupt(output: Path, run_dir: Path, cache: Path, stage: str, sig: int) -> int:
    """Start a run, send ``sig`` once ``stage`` has its first checkpoint; its exit status."""
    child = subprocess.Popen(_command(output, run_dir), cwd=ROOT, env=_env(cache),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    deadline = time.monotonic() + DEADLINE_S
    try:
        while not _steps(output / stage):
            assert child.poll() is None, f"the run ended before {stage} checkpointed: " + (
                child.stdout.read() if child.stdout else ""
            )
            assert time.monotonic() < deadline, f"{stage} never checkpointed"
            time.sleep(0.01)
        child.send_signal(sig)
        child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    return child.returncode


def _weights(output: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(output / "weights.safetensors")


@pytest.mark.slow
def test_a_chain_interrupted_in_two_stages_ends_with_the_uninterrupted_weights(tmp_path):
    cache = tmp_path / "jax-cache"
    whole = tmp_path / "whole"
    done = _run(whole, tmp_path / "run-whole", cache)
    assert done.returncode == 0, done.stderr
    summary = json.loads((whole / "summary.json").read_text())
    assert set(summary["held_out"]) == {"sft", "dpo", "grpo"} and all(summary["trained"].values())
    for stage in ("sft", "dpo", "grpo"):
        assert (whole / stage / "metrics.jsonl").stat().st_size > 0
        assert len((whole / stage / "samples.jsonl").read_text().splitlines()) == 2
    assert (whole / "stages.png").read_bytes()[:4] == b"\x89PNG"

    cut = tmp_path / "cut"
    assert _interrupt(cut, tmp_path / "run-1", cache, "sft", signal.SIGINT) == 130
    assert json.loads((tmp_path / "run-1" / "run.json").read_text())["status"] == "cancelled"
    assert not (cut / "dpo").exists() and max(_steps(cut / "sft")) < TINY["sft_steps"]
    assert _interrupt(cut, tmp_path / "run-2", cache, "dpo", signal.SIGKILL) == -signal.SIGKILL
    assert max(_steps(cut / "sft")) == TINY["sft_steps"]  # SFT finished in the second run
    assert max(_steps(cut / "dpo")) < TINY["dpo_steps"] and not (cut / "grpo").exists()
    resumed = _run(cut, tmp_path / "run-3", cache)
    assert resumed.returncode == 0, resumed.stderr
    assert "sft: restored" in resumed.stdout and "dpo: trained" in resumed.stdout
    again = json.loads((cut / "summary.json").read_text())
    assert again["trained"] == {"sft": False, "dpo": True, "grpo": True}
    assert again["held_out"] == summary["held_out"]

    expected, got = _weights(whole), _weights(cut)
    assert sorted(expected) == sorted(got) and len(expected) > 4
    for name, array in expected.items():
        assert got[name].dtype == array.dtype and np.array_equal(got[name], array), name

    # dew-pipe plot on the stage directories a real run wrote, side by side
    assert main(["plot", *(str(cut / s) for s in ("sft", "dpo", "grpo")), "--side-by-side",
                 "--output", str(tmp_path / "stages.png")]) == 0  # fmt: skip
    assert (tmp_path / "stages.png").read_bytes()[:4] == b"\x89PNG"


def test_dry_run_lists_the_settings_and_the_three_stages(capsys, tmp_path):
    output = tmp_path / "chain"
    assert main(["run", "pipelines/chain.py", "--dry-run", "--set", f"output={output}"]) == 0
    text = capsys.readouterr().out
    assert '"dpo_steps": 50' in text and '"beta": 0.5' in text
    assert not output.exists()  # a dry run writes nothing
