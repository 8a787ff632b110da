"""The embedded default job (pipelines/arithmetic.py) at tiny settings.

One smoke run goes through the command exactly as the README runs it (a subprocess of
``dew-pipe run``), with a few SFT steps and GRPO updates: the run directory must hold the
metrics of both phases, a valid PNG and a summary whose figures match the printed lines and
the recorded probes. Bad settings end with exit status 2 and a one-line message naming the
setting. A cancelled run (the context's cancel event, as Ctrl-C sets it) stops inside GRPO
with the rollout server closed and every thread it started joined.
"""

from __future__ import annotations

import doctest
import importlib
import io
import json
import re
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PIPELINE = ROOT / "pipelines" / "arithmetic.py"
TINY = {
    "sft_steps": 40,
    "eval_every": 20,
    "grpo_steps": 4,
    "grpo_eval_every": 2,
    "prompts": 4,
    "groups": 4,
    "slots": 16,
    "test_size": 100,
    "sample_probe": 50,
}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _command() -> list[str]:
    script = Path(sys.executable).with_name("dew-pipe")
    return [str(script)] if script.exists() else [sys.executable, "-m", "dew_pipe.cli"]


def _run(run_dir: Path, settings: dict[str, object]) -> subprocess.CompletedProcess:
    args = [*_command(), "run", str(PIPELINE), "--run-dir", str(run_dir)]
    for key, value in settings.items():
        args += ["--set", f"{key}={value}"]
    return subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=ROOT)


def _percent(text: str, label: str) -> float:
    found = re.findall(rf"^held-out exact match {label} GRPO: (\d+\.\d)%( \(.*\))?$", text, re.M)
    assert found, f"no line 'held-out exact match {label} GRPO: X%' in:\n{text}"
    return float(found[-1][0])


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory):
    run_dir = tmp_path_factory.mktemp("arithmetic") / "run"
    done = _run(run_dir, TINY)
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir, done.stdout


@pytest.mark.slow
def test_the_job_runs_sft_then_grpo_and_reports_both_accuracies(smoke):
    run_dir, out = smoke
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    values = [r for r in records if r["kind"] == "values"]
    sft = [r for r in values if r.get("phase") == "sft"]
    grpo = [r for r in values if r.get("phase") == "grpo"]
    # SFT: losses, and probes at steps 0, 20 and the end (held-out and sampled reward).
    assert [r["step"] for r in sft if "held_out" in r] == [0, 20, 40]
    assert all("sampled_reward" in r for r in sft if "held_out" in r)
    assert any("loss" in r for r in sft)
    # GRPO (the default: the synchronous loop with the curriculum, the zero-advantage cut
    # and the guide): one record per update with the batch's reward, lag 0, the rested
    # turns, the flat and guided shares and the rows trained; probes every 2 updates, each
    # with grpo_until's check on training problems (40 SFT steps are far from 97%).
    updates = [r for r in grpo if "loss" in r]
    assert [r["step"] for r in updates] == [1, 2, 3, 4]
    assert all(0.0 <= r["reward"] <= 1.0 and r["lag"] == 0 for r in updates)
    assert all({"rested", "flat", "guided", "rows"} <= set(r) for r in updates)
    assert [r["step"] for r in grpo if "held_out" in r] == [0, 2, 4]
    assert [r["step"] for r in grpo if "train_exact" in r] == [2]  # none after the last
    assert all(r["train_exact"] < 0.97 for r in grpo if "train_exact" in r)
    assert not any(r["kind"] == "flow" for r in records)  # no pipeline ran
    # The printed figures are the summary's, which are the first and last probes (on all
    # 100 test problems, so whole percents).
    before, after = _percent(out, "before"), _percent(out, "after")
    assert re.search(r"^held-out exact match after GRPO: .*% \(4 updates\)$", out, re.M)
    assert before == round(100 * summary["before"], 1) and after == round(100 * summary["after"], 1)
    probes = [r["held_out"] for r in values if "held_out" in r]
    assert summary["before"] == sft[-1]["held_out"] and summary["after"] == probes[-1]
    assert round(100 * summary["before"]) == 100 * summary["before"]
    assert summary["settings"]["grpo_steps"] == 4 and summary["wall_s"] > 0
    assert (summary["sft_steps"], summary["grpo_updates"]) == (40, 4)  # nothing stopped early
    assert re.search(r"^wall time: \d+ s \(SFT \d+ s, GRPO \d+ s", out, re.M)
    assert f"run directory: {run_dir}" in out
    assert json.loads((run_dir / "run.json").read_text())["status"] == "done"
    assert (run_dir / "tokenizer" / "tokenizer.json").is_file()


@pytest.mark.slow
def test_the_plot_is_a_png_of_the_expected_size(smoke):
    run_dir, _ = smoke
    data = (run_dir / "progress.png").read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1000, 800)
    assert len(data) > 20_000  # two panels with lines and text, not an empty canvas


@pytest.mark.parametrize(
    "setting, message",
    [
        ("groups=1", "groups is 1; expected an int >= 2"),
        ("aggregation=sum", "aggregation is 'sum'; expected one of"),
        ("max_lag=0", "max_lag is 0 with ahead=1"),
        ("digits=three", "digits"),
        ("learning_rate=0", "learning_rate is 0.0; expected a finite float > 0"),
        ("sft_until=1.5", "sft_until is 1.5"),
        ("sft_check_every=0", "sft_check_every is 0"),
        ("grpo_until=0", "grpo_until is 0.0; expected a finite float > 0"),
        ("rollout=fast", "rollout is 'fast'; expected one of ('async', 'sync')"),
    ],
)
def test_a_bad_setting_exits_2_with_one_line_naming_it(tmp_path, setting, message):
    key, value = setting.split("=")
    done = _run(tmp_path / "run", {key: value})
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dew-pipe: ") and message in lines[0]


@pytest.mark.slow
def test_the_synchronous_rollout_trains_and_logs_like_the_pipeline(tmp_path):
    """rollout=sync: the same job through Trainer(rollout=SampledRollout), no server, no
    pipeline; one record per update (lag 0), the probes at the same steps, the caller's hook
    after every update, and gradients from the task's reward (an untrained model never
    answers right, so the reward here pays for an even first digit, which mixes groups)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from rich.console import Console

    from dew_pipe.cli import load_file
    from dew_pipe.flow import Cancelled, MetricsWriter, RunContext
    from dew_pipe.flow.display import Display
    from dew_pipe.tasks.recipe import SFTRecipe

    settings = {**TINY, "sample_probe": 0, "grpo_steps": 6, "grpo_eval_every": 3, "warmup": 0}
    plain = {"curriculum": 0, "drop_zero_advantage": False, "guide": False, "problems": None}
    job = load_file(PIPELINE).pipeline(**settings, **plain, rollout="sync")
    job.task.reward = lambda source, completion, truth, extra: float(completion[:1] in "02468")
    model = SFTRecipe().model(job.task)
    params = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    seen: list[int] = []
    before = set(threading.enumerate())
    with MetricsWriter(tmp_path / "metrics.jsonl") as metrics:
        context = RunContext(
            tmp_path, {}, metrics, Display(Console(file=io.StringIO()), live=False)
        )
        trained = job.grpo(context, model, params, after_update=lambda n, state: seen.append(n))
    assert seen == [1, 2, 3, 4, 5, 6]  # after every update, the last one included
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    grpo = [r for r in records if r.get("phase") == "grpo"]
    updates = [r for r in grpo if "loss" in r]
    assert [r["step"] for r in updates] == [1, 2, 3, 4, 5, 6]
    assert all(0.0 <= r["reward"] <= 1.0 and r["lag"] == 0 for r in updates)
    assert [r["step"] for r in grpo if "held_out" in r] == [3]  # the last is the caller's
    assert not any(r["kind"] == "flow" for r in records)  # no pipeline ran
    assert 0.0 < np.mean([r["reward"] for r in updates]) < 1.0
    assert max(r["grad_norm"] for r in updates) > 0
    moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - b).max()), trained, params)
    assert max(jax.tree.leaves(moved)) > 1e-4  # Adam steps of 2e-4, not weight decay alone
    assert [t for t in threading.enumerate() if t not in before and t.is_alive()] == []
    # Cancelling (what Ctrl-C sets) stops the loop before the next update.
    cancel, seen = threading.Event(), []

    def stop_at_two(done: int, state) -> None:
        seen.append(done)
        if done == 2:
            cancel.set()

    with MetricsWriter(tmp_path / "again.jsonl") as metrics:
        display = Display(Console(file=io.StringIO()), live=False)
        context = RunContext(tmp_path, {}, metrics, display, cancel)
        with pytest.raises(Cancelled):
            job.grpo(context, model, params, after_update=stop_at_two)
    assert seen == [1, 2]


def test_the_curriculum_rests_solved_problems_in_the_synchronous_loop(tmp_path):
    """curriculum=1: problems whose truth starts with an even digit pay 1 on every
    completion, so after their first group they sit out the next pass; the log counts the
    rested turns. The setting needs rollout=sync, and a pool rather than batches."""
    import jax
    import jax.numpy as jnp
    from rich.console import Console

    from dew_pipe.cli import load_file
    from dew_pipe.data import decode_text_column
    from dew_pipe.flow import MetricsWriter, RunContext
    from dew_pipe.flow.display import Display
    from dew_pipe.tasks.recipe import SFTRecipe

    module = load_file(PIPELINE)
    with pytest.raises(ValueError, match="curriculum is 2 with rollout='async'"):
        module.pipeline(curriculum=2, rollout="async")
    with pytest.raises(ValueError, match="curriculum"):
        module.pipeline(curriculum=-1, rollout="sync")
    with pytest.raises(ValueError, match="problems is 3; expected None or an int >= 4"):
        module.pipeline(problems=3, prompts=4)
    assert module.pipeline(problems=None).settings.problems is None
    settings = {**TINY, "sample_probe": 0, "grpo_steps": 8, "grpo_eval_every": 8, "warmup": 0}
    plain = {"drop_zero_advantage": False, "guide": False}  # on by default with "sync"
    job = module.pipeline(**settings, **plain, rollout="sync", curriculum=1)
    pool = job.task.prompts("train", 8, seed=0).arrays()  # two batches of 4 make a pass
    truths = decode_text_column(pool["ground_truth"])
    even = sum(t[:1] in "02468" for t in truths)
    assert 0 < even < 8
    job.task.reward = lambda source, completion, truth, extra: float(
        truth[:1] in "02468" or completion[:1] in "13579"
    )
    model = SFTRecipe().model(job.task)
    params = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    with MetricsWriter(tmp_path / "metrics.jsonl") as metrics:
        context = RunContext(
            tmp_path, {}, metrics, Display(Console(file=io.StringIO()), live=False)
        )
        job.grpo(context, model, params, prompts=pool)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rested = [r["rested"] for r in records if r.get("phase") == "grpo" and "loss" in r]
    assert len(rested) == 8 and rested[:2] == [0, 0]  # pass 0 serves every problem
    assert rested[-1] >= even  # pass 1 skipped every even-truth problem
    with pytest.raises(TypeError, match="expected the pool as a mapping"):
        job.grpo(context, model, params, prompts=job.task.prompts("train", 8).load(batch=4))
    # drop_zero_advantage: the even-truth problems' groups (all 1) leave the update's rows
    with pytest.raises(ValueError, match="drop_zero_advantage is True with rollout='async'"):
        module.pipeline(drop_zero_advantage=True, rollout="async")
    with pytest.raises(TypeError, match="drop_zero_advantage is 1; expected True or False"):
        module.pipeline(drop_zero_advantage=1, rollout="sync")
    lean = module.pipeline(
        **settings, rollout="sync", curriculum=0, drop_zero_advantage=True, guide=False
    )
    lean.task.reward = job.task.reward
    updates = _grpo_updates(lean, model, params, 32, tmp_path / "lean")
    assert len(updates) == 8
    flat = [r["flat"] for r in updates]
    assert all(r["rows"] % 2 == 0 and r["rows"] <= 16 for r in updates)  # 16 / 8 = 2 a multiple
    # an update's rows: the completions of each problem that is not flat, packed (a row
    # holds one completion, or two short ones), at least 2; none when every group is flat
    kept = [round(4 * (1 - f)) * 4 for f in flat]
    assert all(r["rows"] <= max(2, k) for r, k in zip(updates, kept, strict=True))
    assert all(r["rows"] == 2 for r, k in zip(updates, kept, strict=True) if k == 0)
    assert sum(r["rows"] for r in updates) < 8 * 16  # flat groups (even truths) left out
    # guide: the untrained model answers nothing right, and near-greedy sampling gives each
    # problem one reply G times, so every group is collapsed at 0 and trains on the task's
    # reference answer instead
    with pytest.raises(ValueError, match="guide is True with rollout='async'"):
        module.pipeline(guide=True, rollout="async")
    with pytest.raises(TypeError, match="guide is 1; expected True or False"):
        module.pipeline(guide=1, rollout="sync")
    led = module.pipeline(
        **{**settings, "grpo_steps": 2},
        rollout="sync",
        curriculum=0,
        drop_zero_advantage=False,
        guide=True,
        temperature=1e-3,
        learning_rate=2e-4,  # small enough that the second update's model still knows nothing
    )
    updates = _grpo_updates(led, model, params, 8, tmp_path / "guided")
    assert len(updates) == 2 and all(r["guided"] == 1.0 for r in updates)
    assert all(r["flat"] == 0.0 for r in updates)  # every group now has its winner


@pytest.mark.slow
@pytest.mark.parametrize("rollout", ["sync", "async"])
def test_grpo_until_stops_at_the_first_training_check_that_reaches_it(tmp_path, rollout):
    """grpo_until=0.6 with probes every 2 updates: the training-problem checks read 0.2 and
    then 0.7, so GRPO stops after update 4 of 8, on either rollout; the checks are logged
    as train_exact and read the training problems right after the 40 GRPO trains on (the
    held-out probes the test split)."""
    import jax
    import jax.numpy as jnp
    from rich.console import Console

    from dew_pipe.cli import load_file
    from dew_pipe.flow import MetricsWriter, RunContext
    from dew_pipe.flow.display import Display
    from dew_pipe.tasks.recipe import SFTRecipe

    settings = {**TINY, "sample_probe": 0, "grpo_steps": 8, "grpo_eval_every": 2}
    job = load_file(PIPELINE).pipeline(**settings, rollout=rollout, grpo_until=0.6, problems=40)
    checks, splits = iter([0.2, 0.7]), []

    def evaluate(model, params, split="test", n=None, *, batch=500, start=0):
        splits.append((split, n, start))
        return next(checks) if split == "train" else 0.1

    job.task.evaluate = evaluate
    model = SFTRecipe().model(job.task)
    params = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    seen: list[int] = []
    out = tmp_path / rollout
    out.mkdir()
    with MetricsWriter(out / "metrics.jsonl") as metrics:
        context = RunContext(out, {}, metrics, Display(Console(file=io.StringIO()), live=False))
        job.grpo(context, model, params, after_update=lambda n, state: seen.append(n))
    assert seen == [1, 2, 3, 4] and job.updates == 4
    # the held-out probe reads the whole test split; at the stop it is left to the caller
    assert splits == [("train", 100, 40), ("test", None, 0), ("train", 100, 40)]
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    grpo = [r for r in logged if r.get("phase") == "grpo"]
    assert [r["step"] for r in grpo if "loss" in r] == [1, 2, 3, 4]
    assert [r["step"] for r in grpo if "held_out" in r] == [2]
    assert [(r["step"], r["train_exact"]) for r in grpo if "train_exact" in r] == [
        (2, 0.2),
        (4, 0.7),
    ]


def _grpo_updates(job, model, params, problems: int, out) -> list[dict]:
    """Runs ``job``'s GRPO phase on ``problems`` training problems in batches of 4, logging
    into ``out``; returns the logged update records."""
    from rich.console import Console

    from dew_pipe.flow import MetricsWriter, RunContext
    from dew_pipe.flow.display import Display

    out.mkdir()
    with MetricsWriter(out / "metrics.jsonl") as metrics:
        context = RunContext(out, {}, metrics, Display(Console(file=io.StringIO()), live=False))
        prompts = job.task.prompts("train", problems, seed=0).load(4)
        job.grpo(context, model, params, prompts=prompts)
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in logged if r.get("phase") == "grpo" and "loss" in r]


def test_proximal_in_step_must_be_a_bool():
    from dew_pipe.cli import load_file

    job = load_file(PIPELINE)
    with pytest.raises(TypeError, match="proximal_in_step is 1; expected True or False"):
        job.pipeline(proximal_in_step=1)
    assert job.pipeline(proximal_in_step=False).settings.proximal_in_step is False


def test_unknown_setting_is_refused(tmp_path):
    done = _run(tmp_path / "run", {"grpo_step": 3})
    assert done.returncode == 2 and "grpo_step" in done.stderr


@pytest.mark.slow
def test_cancelling_inside_grpo_closes_the_server_and_joins_every_thread(tmp_path):
    from rich.console import Console

    from dew_pipe.cli import load_file
    from dew_pipe.flow import Cancelled, MetricsWriter, RunContext
    from dew_pipe.flow.display import Display

    settings = {**TINY, "sft_steps": 20, "eval_every": 100, "grpo_steps": 50, "sample_probe": 0}
    job = load_file(PIPELINE).pipeline(**settings, rollout="async")
    cancel = threading.Event()
    console = Console(file=io.StringIO())
    before = set(threading.enumerate())
    updates: list[int] = []
    on_update = job._on_update

    def stop_after_two(step, metrics, record):
        on_update(step, metrics, record)
        updates.append(step)
        if step == 1:
            cancel.set()  # what Ctrl-C does in dew-pipe run

    job._on_update = stop_after_two
    with MetricsWriter(tmp_path / "metrics.jsonl") as metrics:
        context = RunContext(tmp_path, {}, metrics, Display(console, live=False), cancel)
        with pytest.raises(Cancelled):
            job.run(context)
    assert 2 <= len(updates) < 50
    left = [t for t in threading.enumerate() if t not in before and t.is_alive()]
    assert left == [], f"threads still running: {[t.name for t in left]}"
    assert not (tmp_path / "summary.json").exists()


@pytest.mark.parametrize("module", ["pipelines/arithmetic.py", "dew_pipe.tasks.plot"])
def test_docstring_examples_run(module):
    from dew_pipe.cli import load_file

    loaded = load_file(ROOT / module) if module.endswith(".py") else None
    result = doctest.testmod(loaded or importlib.import_module(module))
    assert result.attempted > 0 and result.failed == 0


def _values(path: Path, rows: list[dict]) -> Path:
    lines = [json.dumps({"kind": "flow", "stages": {}})]
    lines += [json.dumps({"kind": "values", **row}) for row in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_plot_run_draws_any_run_directory_again(tmp_path):
    from dew_pipe.tasks.plot import plot_run, read_values

    rows = [{"phase": "sft", "step": s, "elapsed": 1.0 + s, "held_out": s / 10} for s in range(5)]
    rows += [{"phase": "sft", "step": 4, "elapsed": 5.0, "loss": 0.3, "sampled_reward": 0.2}]
    rows += [
        {"phase": "grpo", "step": u, "elapsed": 6.0 + u, "reward": 0.5 + u / 100, "lag": 1}
        for u in range(1, 31)
    ]
    rows += [{"phase": "grpo", "step": 30, "elapsed": 37.0, "held_out": 0.6}]
    rows += [{"phase": "final", "before": 0.4, "after": 0.6}]
    metrics = _values(tmp_path / "metrics.jsonl", rows)
    assert len(read_values(metrics)) == len(rows)  # the flow record is left out
    out = plot_run(metrics, tmp_path / "p.png")
    assert out.read_bytes()[:8] == PNG_SIGNATURE
    # A run with no GRPO yet (cancelled during SFT) still draws, with an empty lower panel.
    early = _values(tmp_path / "early.jsonl", rows[:6])
    assert plot_run(early, tmp_path / "early.png").read_bytes()[:8] == PNG_SIGNATURE


def test_plot_run_refuses_files_it_cannot_read(tmp_path):
    from dew_pipe.tasks.plot import plot_run, read_values

    with pytest.raises(ValueError, match="no values records of phase 'sft' or 'grpo'"):
        plot_run(_values(tmp_path / "other.jsonl", [{"loss": 1.0}]), tmp_path / "x.png")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"kind": "values", "phase": "sft"}\n{not json\n')
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        read_values(broken)
    assert not (tmp_path / "x.png").exists()
