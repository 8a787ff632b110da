"""pipelines/rlvr.py: RLVR on generated code, graded in bubblewrap.

A tiny run goes through ``dew-pipe run`` as the README runs it: the run directory must hold
both phases' probes, GRPO updates whose sandbox counters grow, a PNG and a summary matching
the printed lines. The dry run lists the settings without compiling or sandboxing anything;
bad settings end with exit status 2 and one line naming the setting; a machine where bwrap
cannot sandbox ends the job before any training, with bwrap's reason and the way out.
"""

from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from sandbox_helpers import bubblewrap_runner

ROOT = Path(__file__).resolve().parents[1]
PIPELINE = ROOT / "pipelines" / "rlvr.py"
TINY = {
    "sft_steps": 80,  # enough for closed python blocks, so the sandbox grades something
    "eval_every": 40,
    "grpo_steps": 4,
    "grpo_eval_every": 2,
    "prompts": 4,
    "groups": 4,
    "slots": 16,
    "test_size": 20,
}


def _command() -> list[str]:
    script = Path(sys.executable).with_name("dew-pipe")
    return [str(script)] if script.exists() else [sys.executable, "-m", "dew_pipe.cli"]


def _run(pipeline: Path, run_dir: Path, settings: dict, *extra: str) -> subprocess.CompletedProcess:
    args = [*_command(), "run", str(pipeline), "--run-dir", str(run_dir), *extra]
    for key, value in settings.items():
        args += ["--set", f"{key}={value}"]
    return subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=ROOT)


def _percent(text: str, label: str) -> float:
    found = re.findall(rf"^held-out pass rate {label} GRPO: (\d+\.\d)%$", text, re.M)
    assert found, f"no line 'held-out pass rate {label} GRPO: X%' in:\n{text}"
    return float(found[-1])


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory):
    bubblewrap_runner()  # skips (outside CI) where bwrap cannot sandbox
    run_dir = tmp_path_factory.mktemp("rlvr") / "run"
    done = _run(PIPELINE, run_dir, TINY)
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir, done.stdout


@pytest.mark.slow
def test_a_tiny_run_trains_both_phases_and_grades_in_the_sandbox(smoke):
    run_dir, out = smoke
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    values = [r for r in records if r["kind"] == "values"]
    sft = [r for r in values if r.get("phase") == "sft"]
    grpo = [r for r in values if r.get("phase") == "grpo"]
    assert [r["step"] for r in sft if "held_out" in r] == [0, 40, 80]
    assert any("loss" in r for r in sft)
    updates = [r for r in grpo if "loss" in r]
    assert [r["step"] for r in updates] == [1, 2, 3, 4]
    assert all(0.0 <= r["reward"] <= 1.0 and r["lag"] in (0, 1) for r in updates)
    # Every update's completions went through the sandbox (or its memo of earlier runs).
    graded = [r["programs_run"] + r["programs_memo"] for r in updates]
    assert graded == sorted(graded) and graded[-1] > 0
    assert [r["step"] for r in grpo if "held_out" in r] == [0, 2, 4]
    assert any(r["kind"] == "flow" for r in records)
    # Printed figures are the summary's, which are the first and last probes (20 prompts).
    before, after = _percent(out, "before"), _percent(out, "after")
    assert before == round(100 * summary["before"], 1) and after == round(100 * summary["after"], 1)
    probes = [r for r in values if "held_out" in r]
    assert summary["before"] == sft[-1]["held_out"] and summary["after"] == probes[-1]["held_out"]
    assert summary["reward_after"] == probes[-1]["held_out_reward"]
    assert summary["runner"] == "bubblewrap" and summary["programs_run"] > 0
    assert summary["programs_run"] >= updates[-1]["programs_run"]  # the last probe adds some
    assert summary["programs_memo"] >= updates[-1]["programs_memo"]
    assert "graded on BubblewrapRunner(" in out
    assert re.search(r"^wall time: \d+ s \(SFT \d+ s, GRPO \d+ s", out, re.M)
    assert json.loads((run_dir / "run.json").read_text())["status"] == "done"
    png = (run_dir / "progress.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", png[16:24]) == (1000, 800)


def test_the_dry_run_lists_the_settings_without_sandboxing(tmp_path):
    done = _run(PIPELINE, tmp_path / "run", {"grpo_steps": 7}, "--dry-run")
    assert done.returncode == 0, done.stderr
    settings = json.loads(done.stdout[: done.stdout.index("\n}\n") + 2])
    assert settings["grpo_steps"] == 7 and settings["runner"] == "bubblewrap"
    assert "RLVRJob(" in done.stdout and not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    ("settings", "error", "message"),
    [
        ({"runner": "docker"}, ValueError, "runner is 'docker'; expected one of"),
        ({"operations": "sum,cube"}, ValueError, "operations holds 'cube'"),
        ({"operations": "sum"}, ValueError, "expected at least two"),
        ({"groups": 1}, ValueError, "groups is 1; expected an int >= 2"),
        ({"cases": 0}, ValueError, "cases is 0; expected an int >= 1"),
        ({"wall_seconds": 0.0}, ValueError, "wall_seconds is 0.0; expected a finite float > 0"),
        ({"max_lag": 0}, ValueError, "max_lag is 0 with ahead=1"),
        ({"sandbox_workers": 0}, ValueError, "sandbox_workers is 0; expected an int >= 1"),
        ({"sft_steps": 1.5}, TypeError, "sft_steps is 1.5"),
    ],
)
def test_bad_settings_are_refused_when_the_job_is_made(settings, error, message):
    from dew_pipe.cli import load_file

    with pytest.raises(error, match=re.escape(message)):
        load_file(PIPELINE).pipeline(**settings)


def test_a_bad_setting_on_the_command_line_exits_2_with_one_line(tmp_path):
    done = _run(PIPELINE, tmp_path / "run", {"runner": "docker"})
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert (
        len(lines) == 1 and lines[0].startswith("dew-pipe: ") and "runner is 'docker'" in lines[0]
    )


NO_BWRAP = """
from pathlib import Path

from dew_pipe.cli import load_file
from dew_pipe.sandbox import runners

runners.find_bwrap = lambda: "/bin/false"  # a bwrap that cannot make its namespaces
pipeline = load_file(Path({pipeline!r})).pipeline
"""


def test_a_machine_where_bwrap_cannot_sandbox_fails_before_training(tmp_path):
    wrapper = tmp_path / "no_bwrap.py"
    wrapper.write_text(NO_BWRAP.format(pipeline=str(PIPELINE)))
    done = _run(wrapper, tmp_path / "run", {})
    assert done.returncode == 1, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert "bubblewrap (/bin/false) cannot sandbox here" in line
    assert "unprivileged user namespaces" in line and "--set runner=process" in line
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert '"phase": "sft"' not in metrics  # nothing trained
