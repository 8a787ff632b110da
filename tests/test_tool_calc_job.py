"""The multi-turn tool-use job (pipelines/tool_calc.py): dry run, refusals, a tiny run.

The tiny run goes through ``dew-pipe run`` exactly as the README runs it, with a few SFT
steps and GRPO updates on episodes whose tool is a real worker process: the run directory
must hold both phases' metrics, a PNG and a summary whose figures match the printed lines.
Bad settings end with exit status 2 and one line naming the setting. A cancelled run stops
inside GRPO with its servers closed, every thread it started joined and no worker left.
"""

from __future__ import annotations

import doctest
import io
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PIPELINE = ROOT / "pipelines" / "tool_calc.py"
TINY = {
    "sft_steps": 30,
    "grpo_steps": 4,
    "eval_every": 2,
    "prompts": 2,
    "groups": 4,
    "slots": 8,
    "workers": 8,
    "test_size": 8,
}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _command() -> list[str]:
    script = Path(sys.executable).with_name("dew-pipe")
    return [str(script)] if script.exists() else [sys.executable, "-m", "dew_pipe.cli"]


def _run(run_dir: Path, settings: dict[str, object], *extra: str) -> subprocess.CompletedProcess:
    args = [*_command(), "run", str(PIPELINE), "--run-dir", str(run_dir), *extra]
    for key, value in settings.items():
        args += ["--set", f"{key}={value}"]
    return subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=ROOT)


def _percent(text: str, label: str) -> float:
    found = re.findall(rf"^held-out success {label} GRPO: (\d+\.\d)% \(tool calls", text, re.M)
    assert found, f"no line 'held-out success {label} GRPO: X%' in:\n{text}"
    return float(found[-1])


def test_the_dry_run_lists_the_settings_and_compiles_nothing(tmp_path):
    done = _run(tmp_path / "run", {"grpo_steps": 7}, "--dry-run")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "grpo_steps" in done.stdout and "tool_share" in done.stdout and "7" in done.stdout
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    "setting, message",
    [
        ({"groups": 1}, "groups is 1; expected an int >= 2"),
        ({"tool_share": 1.5}, "tool_share is 1.5"),
        ({"max_turns": 1}, "max_turns is 1; expected an int >= 2"),
        ({"max_lag": 0}, "max_lag is 0 with ahead=1"),
        ({"learning_rate": 0.0}, "learning_rate is 0.0; expected a finite float > 0"),
        ({"workers": 0}, "workers is 0; expected an int >= 1"),
    ],
)
def test_bad_settings_are_refused_naming_the_setting(setting, message):
    from dew_pipe.cli import load_file

    with pytest.raises(ValueError, match=re.escape(message)):
        load_file(PIPELINE).pipeline(**setting)


def test_a_bad_setting_exits_2_with_one_line_naming_it(tmp_path):
    done = _run(tmp_path / "run", {"tool_share": "1.5"})
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dew-pipe: ") and "tool_share is 1.5" in lines[0]


def test_docstring_examples_run():
    from dew_pipe.cli import load_file

    result = doctest.testmod(load_file(PIPELINE))
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.slow
def test_a_tiny_run_trains_on_worker_episodes_and_reports_both_figures(tmp_path):
    run_dir = tmp_path / "run"
    done = _run(run_dir, TINY)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    values = [r for r in records if r["kind"] == "values"]
    sft = [r for r in values if r.get("phase") == "sft"]
    grpo = [r for r in values if r.get("phase") == "grpo"]
    assert any("loss" in r for r in sft) and [r["step"] for r in sft if "held_out" in r] == [0]
    updates = [r for r in grpo if "loss" in r]
    assert [r["step"] for r in updates] == [1, 2, 3, 4]
    assert all(0.0 <= r["reward"] <= 1.0 and r["lag"] in (0, 1) for r in updates)
    assert all(r["calls_per_chain"] >= 1.0 for r in updates)
    assert [r["step"] for r in grpo if "held_out" in r] == [0, 2, 4]  # 0: the SFT's figure
    assert any(r["kind"] == "flow" for r in records)  # the GRPO pipeline's counters
    before, after = _percent(out, "before"), _percent(out, "after")
    assert before == round(100 * summary["before"], 1) and after == round(100 * summary["after"], 1)
    assert summary["before"] == sft[-1]["held_out"]
    assert summary["after"] == [r["held_out"] for r in grpo if "held_out" in r][-1]
    assert round(8 * summary["before"]) == 8 * summary["before"]  # 8 episodes, one per problem
    assert summary["settings"]["grpo_steps"] == 4 and summary["cpu_s"] > 0
    assert re.search(r"^wall time: \d+ s \(SFT \d+ s, GRPO \d+ s", out, re.M)
    data = (run_dir / "progress.png").read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 20_000
    assert json.loads((run_dir / "run.json").read_text())["status"] == "done"
    assert (run_dir / "tokenizer" / "tokenizer.json").is_file()


def _children() -> set[int]:
    """Pids of this process's live child processes (the tool workers' supervisors)."""
    me, found = os.getpid(), set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == me and fields[0] != "Z":
                found.add(int(entry.name))
    return found


@pytest.mark.slow
def test_cancelling_inside_grpo_closes_everything_and_leaves_no_worker(tmp_path):
    from rich.console import Console

    from dew_pipe.cli import load_file
    from dew_pipe.flow import Cancelled, MetricsWriter, RunContext
    from dew_pipe.flow.display import Display

    settings = {**TINY, "sft_steps": 10, "eval_every": 100, "grpo_steps": 50}
    job = load_file(PIPELINE).pipeline(**settings)
    cancel = threading.Event()
    before, children = set(threading.enumerate()), _children()
    updates: list[int] = []
    on_update = job._on_update

    def stop_after_two(pipeline, greedy, episodes, step, metrics, record):
        on_update(pipeline, greedy, episodes, step, metrics, record)
        updates.append(step)
        if step == 1:
            cancel.set()  # what Ctrl-C does in dew-pipe run

    job._on_update = stop_after_two
    with MetricsWriter(tmp_path / "metrics.jsonl") as metrics:
        display = Display(Console(file=io.StringIO()), live=False)
        context = RunContext(tmp_path, {}, metrics, display, cancel)
        with pytest.raises(Cancelled):
            job.run(context)
    assert 2 <= len(updates) < 50
    left = [t for t in threading.enumerate() if t not in before and t.is_alive()]
    assert left == [], f"threads still running: {[t.name for t in left]}"
    assert _children() <= children, "a tool worker outlived the run"
    assert not (tmp_path / "summary.json").exists()
