"""What a run prints where no terminal is attached: short status lines with current values
only, and no "PyTorch was not found" notice from transformers (issue 17 item 6)."""

from __future__ import annotations

import io
import json
import time

from fault_helpers import run_cli, run_python
from rich.console import Console

from dew_pipe.flow.display import Display
from dew_pipe.flow.metrics import EdgeStats, FlowSnapshot, StageStats

NOTICE = "PyTorch was not found"

# The embedded job's GRPO graph, as wide as it is in pipelines/arithmetic.py.
STAGES = ("tasks", "rollout", "admit", "pack", "rescore", "update", "weights", "reward")
EDGES = tuple(f"{a}.out->{b}.in" for a, b in zip(STAGES, STAGES[1:], strict=False)) + (
    "pack.resubmit->rollout.resubmit",
    "update.weights->rollout.weights",
)


def _snapshot(elapsed: float, busy: dict[str, float]) -> FlowSnapshot:
    stages = {
        n: StageStats(n, "running", 10, 10, 0, busy.get(n, 0.0), 0.5, 0.5, elapsed) for n in STAGES
    }
    edges = {e: EdgeStats(e, 4, "resubmit" in e, 40, 2, 4, 1.25, 0.75, 0, False) for e in EDGES}
    return FlowSnapshot("arithmetic-grpo", elapsed, stages, edges)


def test_the_transformers_torch_notice_is_not_printed_but_other_messages_are():
    plain = run_python("import transformers")  # the control: without dew_pipe it is there
    assert NOTICE in plain.stderr
    ours = run_python(
        """
        import logging
        import dew_pipe
        import transformers
        from dew_pipe.data.tokenizer import build_tokenizer
        build_tokenizer(["a b c"] * 4, vocab_size=300)
        logging.getLogger("transformers").warning("another transformers message")
        """
    )
    assert ours.returncode == 0, ours.stderr
    assert NOTICE not in ours.stderr
    assert "another transformers message" in ours.stderr


def test_plain_lines_show_the_current_phase_and_only_values_set_since_the_last_line():
    out = io.StringIO()
    display = Display(Console(file=out, width=1000), live=False, interval=3600, title="arith")
    display.progress("SFT steps", 100, 1500)
    display.values(step=100, phase="sft", held_out=0.52, sampled_reward=0.61)
    display.close()  # the interval never passes here: close prints the line
    sft_line = out.getvalue().splitlines()[-1]
    assert "SFT steps 100/1500" in sft_line and "sampled_reward=0.61" in sft_line

    display.progress("SFT steps", 1500, 1500)
    display.values(step=0, phase="grpo", held_out=0.98, sampled_reward=0.97)
    display.flow(_snapshot(100.0, {"update": 50.0, "rollout": 20.0}))
    display._emit()  # the line at the start of GRPO
    for step in range(1, 4):  # GRPO reports its updates; the SFT probe is not logged again
        display.progress("GRPO updates", step, 1000)
        display.values(step=step, phase="grpo", loss=0.01 * step, reward=0.8, lag=1)
    display.flow(_snapshot(110.0, {"update": 59.3, "rollout": 24.0}))
    line = display.line()
    assert "GRPO updates 3/1000" in line
    assert "SFT steps" not in line  # a finished phase's counter drops out
    assert "sampled_reward" not in line and "held_out" not in line  # stale: not repeated
    assert "loss=0.03" in line and "step=3" in line and line.count("loss=") == 1
    assert "busiest update 93%" in line  # 9.3 busy seconds of the last 10
    assert "queues" not in line and "->" not in line  # per-queue detail: metrics.jsonl
    assert len(line) < 160, line


def test_a_line_without_news_keeps_the_phase_but_drops_old_values():
    out = io.StringIO()
    display = Display(Console(file=out, width=1000), live=False, interval=3600)
    display.progress("steps", 5, 10)
    display.values(loss=0.5)
    display._emit()
    display._emit()
    first, second = out.getvalue().splitlines()
    assert "loss=0.5" in first and "steps 5/10" in first
    assert "loss" not in second and "steps 5/10" in second and "/s" not in second


def test_cli_status_lines_off_a_terminal_are_short_and_metrics_keep_the_detail(tmp_path):
    done = run_cli("run", "pipelines/demo.py", "--run-dir", tmp_path / "run", deadline=120)
    assert done.returncode == 0, done.stderr
    status = [line for line in done.stdout.splitlines() if line.startswith("[")]
    assert status, done.stdout
    for line in status:
        assert len(line) < 200, line
        assert "queues" not in line and "stages:" not in line
    assert NOTICE not in done.stderr
    flows = [
        json.loads(line)
        for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
        if '"kind": "flow"' in line
    ]
    assert flows and flows[-1]["edges"] and flows[-1]["stages"]  # the detail is all there


def test_plain_line_rate_is_over_the_last_interval():
    out = io.StringIO()
    display = Display(Console(file=out, width=1000), live=False, interval=3600)
    display.progress("steps", 0, 100)
    time.sleep(0.2)
    display.progress("steps", 10, 100)
    display._emit()
    display.progress("steps", 11, 100)  # one step in the next interval
    time.sleep(0.2)
    display.progress("steps", 12, 100)
    (first,) = out.getvalue().splitlines()
    rate_first = float(first.split("steps 10/100 ")[1].split("/s")[0])
    rate_now = float(display.line().split("steps 12/100 ")[1].split("/s")[0])
    assert 20 < rate_first < 60 and rate_now < 15  # 10 steps in 0.2 s, then 2 in 0.2 s


def test_updates_held_together_reach_one_line_together():
    out = io.StringIO()
    display = Display(Console(file=out, width=1000), live=False, interval=0)
    with display.held():  # interval 0: each update alone would print a line
        display.progress("dpo steps", 10, 50)
        display.values(step=10, phase="dpo", loss=0.6)
        assert out.getvalue() == ""
    (line,) = out.getvalue().splitlines()
    assert "dpo steps 10/50" in line and "step=10 phase=dpo loss=0.6" in line
