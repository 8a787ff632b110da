"""`dew-pipe run` end to end in subprocesses, and the remaining paths in process."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dew_pipe.cli import main

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "pipelines" / "demo.py"


def _cli(*args, cwd=None, timeout=60):
    return subprocess.run(
        [sys.executable, "-m", "dew_pipe.cli", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=timeout,
    )


def _write(tmp_path, name, body):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


FAILING = """
    from dew_pipe.flow import Map, Pipeline, Sink, Source

    def boom(x):
        if x == 2:
            raise ValueError("reward crashed on 2")
        return x

    def pipeline(n: int = 5):
        p = Pipeline("failing")
        p.chain(Source("src", lambda: range(n), output_type=int),
                Map("score", boom, input_type=int),
                Sink("sink", lambda x: None, input_type=int), capacity=1)
        return p
"""

ENDLESS = """
    import itertools, threading
    from dew_pipe.flow import Pipeline, Sink, Source, Stage

    class Stubborn(Stage):  # ignores cancellation, like a blocking C call
        def __init__(self):
            super().__init__("stubborn", inputs={"in": int})
        def run(self, ctx):
            ctx.get("in")
            threading.Event().wait()

    def pipeline(stubborn: bool = False):
        p = Pipeline("endless")
        src = Source("src", lambda: (i for i in itertools.count() if not __import__("time").sleep(0.01)),
                     output_type=int)
        sink = Stubborn() if stubborn else Sink("sink", lambda x: None, input_type=int)
        p.chain(src, sink, capacity=2)
        return p
"""


def test_demo_runs_end_to_end_and_writes_the_run_directory(tmp_path):
    run_dir = tmp_path / "run"
    result = _cli("run", DEMO, "--set", "batches=3", "--set", "slow_ms=5", "--run-dir", run_dir,
                  "--metrics-every", "0.1")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "admitted every one of 24 tasks once" in result.stdout
    assert f"run directory {run_dir}" in result.stdout and result.stderr == ""
    config = json.loads((run_dir / "config.json").read_text())
    assert config["batches"] == 3 and config["slow_ms"] == 5.0 and config["width"] == 128
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    final = [r for r in records if r["kind"] == "flow"][-1]
    assert final["stages"]["tasks"]["items_out"] == 3
    assert (
        final["stages"]["rollout"]["items_in"]
        == 3 + final["edges"]["gate.retry->rollout.retry"]["items"]
    )
    assert final["edges"]["gate.retry->rollout.retry"]["feedback"] is True
    assert all(s["state"] == "done" for s in final["stages"].values())
    info = json.loads((run_dir / "run.json").read_text())
    assert info["status"] == "done" and info["error"] is None and info["entry"] == "pipeline"


def test_bad_override_lists_valid_settings_and_exits_2(tmp_path):
    result = _cli("run", DEMO, "--set", "batches=many", cwd=tmp_path)
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert line.startswith("dew-pipe: setting 'batches': 'many' is not an int; valid settings:")
    assert "slow_ms (float, default 60.0)" in line and "Traceback" not in result.stderr
    unknown = _cli("run", DEMO, "--set", "speed=3", cwd=tmp_path)
    assert (
        unknown.returncode == 2
        and "unknown setting 'speed'; valid settings: batches" in unknown.stderr
    )
    assert not (tmp_path / "runs").exists()  # nothing ran, nothing written


def test_file_without_pipeline_exits_2(tmp_path):
    path = _write(tmp_path, "empty.py", "x = 1\n")
    result = _cli("run", path, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr == (
        f"dew-pipe: {path} defines no `pipeline` (a Pipeline, or a function returning one) and "
        "no `main` function; nothing to run\n"
    )


def test_failing_stage_exits_1_with_one_line_and_traceback_only_in_debug(tmp_path):
    path = _write(tmp_path, "failing.py", FAILING)
    result = _cli("run", path, "--run-dir", tmp_path / "r")
    assert result.returncode == 1
    assert (
        result.stderr
        == "dew-pipe: stage 'score' failed on item 2: ValueError: reward crashed on 2\n"
    )
    info = json.loads((tmp_path / "r" / "run.json").read_text())
    assert info["status"] == "failed" and "reward crashed on 2" in info["error"]
    debug = _cli("run", path, "--run-dir", tmp_path / "r2", "--debug")
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "in boom" in debug.stderr
    assert debug.stderr.endswith(
        "dew-pipe: stage 'score' failed on item 2: ValueError: reward crashed on 2\n"
    )


def _start(path, run_dir, *extra):
    proc = subprocess.Popen(
        [sys.executable, "-m", "dew_pipe.cli", "run", str(path), "--run-dir", str(run_dir),
         "--metrics-every", "0.05", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 30
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().strip()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr
        time.sleep(0.05)
    return proc


def test_ctrl_c_cancels_cooperatively_with_exit_130(tmp_path):
    path = _write(tmp_path, "endless.py", ENDLESS)
    proc = _start(path, tmp_path / "r")
    start = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 130 and time.monotonic() - start < 5
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[0] == "dew-pipe: cancelling (Ctrl-C again to exit at once)"
    assert lines[-1].startswith("dew-pipe: cancelled by Ctrl-C after") and len(lines) == 2
    assert json.loads((tmp_path / "r" / "run.json").read_text())["status"] == "cancelled"


def test_second_ctrl_c_forces_exit(tmp_path):
    path = _write(tmp_path, "endless.py", ENDLESS)
    proc = _start(path, tmp_path / "r", "--set", "stubborn=true")
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    assert proc.poll() is None  # the stubborn stage ignores cancellation (join_timeout 10 s)
    start = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 130 and time.monotonic() - start < 3
    assert "dew-pipe: interrupted twice; exiting now" in err and "Traceback" not in err


# ----------------------------------------------------------------------------- in process


def test_help_and_no_command(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0 and "run" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    text = capsys.readouterr().out
    assert "--set KEY=VALUE" in text and "exit status" in text and "RunContext" in text
    assert main([]) == 2 and "usage: dew-pipe" in capsys.readouterr().err


def test_job_with_run_context(tmp_path, capsys):
    path = _write(tmp_path, "job.py", """
        class Job:
            def __init__(self, steps):
                self.steps = steps
            def run(self, context):
                for step in range(self.steps):
                    context.progress("steps", step + 1, self.steps)
                    context.log(step=step, loss=1.0 / (step + 1))
                context.print(f"trained {self.steps} steps in {context.run_dir.name}")

        def main(steps: int = 2):
            return Job(steps)
    """)  # fmt: skip
    assert main(["run", str(path), "--set", "steps=4", "--run-dir", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert "trained 4 steps in r" in out
    records = [
        json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()
    ]
    losses = [r["loss"] for r in records if r["kind"] == "values"]
    assert losses == [1.0, 0.5, 1 / 3, 0.25]
    assert json.loads((tmp_path / "r" / "run.json").read_text())["entry"] == "main"
    assert json.loads((tmp_path / "r" / "config.json").read_text()) == {"steps": 4}


def test_job_raising_fails_with_one_line(tmp_path, capsys):
    path = _write(tmp_path, "bad_job.py", """
        class Job:
            def run(self, context):
                raise RuntimeError("out of memory")

        def main():
            return Job()
    """)  # fmt: skip
    assert main(["run", str(path), "--run-dir", str(tmp_path / "r")]) == 1
    assert capsys.readouterr().err == "dew-pipe: bad_job.py failed: RuntimeError: out of memory\n"


@pytest.mark.parametrize(
    "body, args, message",
    [
        ("def pipeline(:\n", [], "could not load {path}: SyntaxError"),
        ("pipeline = 3\n", [], "`pipeline` is a int; expected a dew_pipe.flow.Pipeline"),
        ("def main():\n    return 3\n", [], "main() returned a int; expected a dew_pipe.flow.Pipeline"),
        (
            "from dew_pipe.flow import Pipeline, Source, Sink\n"
            "pipeline = Pipeline('fixed')\n"
            "pipeline.chain(Source('s', lambda: [], output_type=int),"
            " Sink('k', print, input_type=int), capacity=1)\n",
            ["--set", "n=1"],
            "defines a Pipeline object, which has no settings",
        ),
        (
            "from dew_pipe.flow import Pipeline, Source\n"
            "def pipeline():\n"
            "    p = Pipeline('dangling')\n"
            "    p.add(Source('s', lambda: [], output_type=int))\n"
            "    return p\n",
            [],
            "stage 's' output port 'out' (int) is not connected",
        ),
        ("def main(width: int = 4):\n    raise ValueError(f'width={width} too small')\n",
         [], "main() refused its settings: ValueError: width=4 too small"),
    ],
)  # fmt: skip
def test_nothing_to_run_exits_2_with_one_line(tmp_path, capsys, body, args, message):
    path = tmp_path / "case.py"
    path.write_text(body)
    assert main(["run", str(path), *args]) == 2
    err = capsys.readouterr().err
    assert message.format(path=path) in err and err.count("\n") == 1 and "Traceback" not in err
    assert main(["run", str(tmp_path / "missing.py")]) == 2
    assert "missing.py: no such file" in capsys.readouterr().err


def test_dry_run_prints_settings_and_graph_without_running(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["run", str(DEMO), "--dry-run", "--set", "workers=3"]) == 0
    out = capsys.readouterr().out
    assert '"workers": 3' in out and "gate.retry->rollout.retry (capacity 10, feedback)" in out
    assert not (tmp_path / "runs").exists()


def test_default_run_dir_is_unique_per_run(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = _write(tmp_path, "tiny.py", """
        from dew_pipe.flow import Pipeline, Sink, Source
        def pipeline(n: int = 3):
            p = Pipeline("tiny")
            p.chain(Source("s", lambda: range(n), output_type=int),
                    Sink("k", lambda x: None, input_type=int), capacity=1)
            return p
    """)  # fmt: skip
    assert main(["run", str(path)]) == 0 and main(["run", str(path)]) == 0
    dirs = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert len(dirs) == 2 and all(d.startswith("tiny-") for d in dirs)
    assert all((tmp_path / "runs" / d / "metrics.jsonl").exists() for d in dirs)


def test_console_script_is_installed():
    script = Path(sys.executable).with_name("dew-pipe")
    if not script.exists():
        pytest.skip("dew-pipe console script not installed in this environment")
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "run a pipeline file" in result.stdout
    assert os.access(script, os.X_OK)
