"""Standing fault suite, part 1: the flow runtime and the ``dew-pipe`` command.

Each case injects one fault (a stage that raises, hangs or lies about its types; a bad file,
setting or directory) and checks what a user relies on: the error names the thing, the exit
status is right, no thread or process is left behind and nothing half-written is left. Cases
that could hang run in a child process with a deadline (``fault_helpers.run_python``), so a
hang fails the test instead of stalling the suite. The other parts: test_faults_data.py
(Beam and pack jobs, packing, model loading, chat data, the trainer).
"""

from __future__ import annotations

import json
import threading
import time

import pytest
from fault_helpers import child_pids, flow_threads, one_line, run_cli, run_python

from dew_pipe.flow import (
    BuildError,
    Cancelled,
    Map,
    Pipeline,
    RunTimeout,
    Sink,
    Source,
    Stage,
    StageFailed,
    StageTimeout,
)

BOUND_S = 5.0  # an in-process failure must surface well within this

# ------------------------------------------------------------------ a stuck thread never
# keeps the process alive (issue 11 item 1): the run fails on time AND the process exits.

_STUCK_PRELUDE = """
import threading, time
from dew_pipe.flow import Map, Pipeline, Sink, Source, Stage, StageFailed, Cancelled
never = threading.Event()
def hang(x):
    never.wait()
"""

STUCK_CASES = {
    "map_workers_2": "Map('hang', hang, input_type=int, output_type=int, workers=2, timeout=0.3)",
    "map_workers_1": "Map('hang', hang, input_type=int, output_type=int, timeout=0.3)",
    "map_unordered": (
        "Map('hang', hang, input_type=int, output_type=int, workers=3, ordered=False, timeout=0.3)"
    ),
}


@pytest.mark.parametrize("stage", list(STUCK_CASES.values()), ids=list(STUCK_CASES))
def test_stuck_map_fails_on_time_and_the_process_exits(stage):
    code = (
        _STUCK_PRELUDE
        + f"""
p = Pipeline("stuck")
p.chain(Source("src", lambda: range(5), output_type=int), {stage},
        Sink("sink", lambda x: None, input_type=int), capacity=1)
start = time.monotonic()
try:
    p.run(timeout=20, join_timeout=0.2)
except StageFailed as e:
    print("FAILED", e.stage, round(time.monotonic() - start, 1))
"""
    )
    result = run_python(code, deadline=20)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("FAILED hang"), result.stdout


def test_stuck_sink_and_source_are_left_as_daemons():
    code = (
        _STUCK_PRELUDE
        + """
def stuck_items():
    yield 0
    never.wait()
for name, stages in {
    "sink": [Source("src", lambda: range(3), output_type=int),
             Sink("sink", hang, input_type=int, timeout=0.3)],
    "source": [Source("src", stuck_items, output_type=int),
               Sink("sink", lambda x: None, input_type=int)],
}.items():
    p = Pipeline(name)
    p.chain(*stages, capacity=1)
    try:
        p.run(timeout=1.0, join_timeout=0.2)
    except (StageFailed, Cancelled) as e:
        print(name, type(e).__name__, e.stuck)
"""
    )
    result = run_python(code, deadline=20)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "sink StageFailed ('flow:sink:sink',)"
    assert lines[1] == "source RunTimeout ('flow:source:src',)"


def test_stuck_reward_stage_does_not_keep_the_process_alive():
    code = """
import threading
from dew_pipe.flow import Pipeline, Sink, Source, StageFailed
from dew_pipe.objectives.rl.session_records import Call, Session
from dew_pipe.stages.messages import SESSION_ROWS, Stamps, stamp_sessions
from dew_pipe.stages.reward import Reward
never = threading.Event()
call = Call([1], [7], [-0.1], "stop", 0)
batch = lambda i: stamp_sessions([Session(i, 0, 0, 0, [call], "COMPLETED")], [Stamps(0, 0, 0.1)])
reward = Reward(lambda task, s: never.wait(), workers=2)
reward.timeout = 0.3
p = Pipeline("reward")
p.chain(Source("src", lambda: [batch(i) for i in range(4)], output_type=SESSION_ROWS), reward,
        Sink("sink", lambda x: None, input_type=SESSION_ROWS), capacity=1)
try:
    p.run(timeout=20, join_timeout=0.2)
except StageFailed as e:
    print("FAILED", e.stage)
"""
    result = run_python(code, deadline=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "FAILED reward"


def test_worker_pool_with_a_stuck_call_does_not_keep_the_process_alive():
    code = """
import threading
from dew_pipe._pool import WorkerPool
pool = WorkerPool(2, name="stuck")
future = pool.submit(threading.Event().wait)
pool.shutdown(wait=False, cancel_futures=True)
print("main done", future.running())
"""
    result = run_python(code, deadline=15)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "main done True"


def test_cli_run_with_a_stuck_worker_prints_its_line_and_exits(tmp_path):
    (tmp_path / "stuck.py").write_text(
        "import threading\n"
        "from dew_pipe.flow import Map, Pipeline, Sink, Source\n"
        "never = threading.Event()\n"
        "class Job:\n"
        "    def run(self, context):\n"
        "        p = Pipeline('stuck')\n"
        "        p.chain(Source('src', lambda: range(3), output_type=int),\n"
        "                Map('hang', lambda x: never.wait(), input_type=int, output_type=int,\n"
        "                    workers=2, timeout=0.3),\n"
        "                Sink('sink', lambda x: None, input_type=int), capacity=1)\n"
        "        return p.run(cancel=context.cancel, join_timeout=0.2)\n"
        "def main():\n"
        "    return Job()\n"
    )
    result = run_cli("run", tmp_path / "stuck.py", "--run-dir", tmp_path / "run", deadline=30)
    assert result.returncode == 1
    line = one_line(result.stderr)
    assert line.startswith("dew-pipe: stage 'hang' failed on item 0: StageTimeout")
    assert "flow:stuck:hang/worker_0" in line
    assert json.loads((tmp_path / "run" / "run.json").read_text())["status"] == "failed"


# ------------------------------------------------------------------ blame: the error names
# the stage and the item (issue 11 item 2 for sources).


def _raise_at(n):
    def fn(x):
        if x == n:
            raise ValueError(f"bad item {x}")
        return x

    return fn


def _source_raising_at(n):
    def items():
        yield from range(n)
        raise ValueError(f"cannot read item {n}")

    return items


def _assert_no_threads(name):
    deadline = time.monotonic() + BOUND_S
    while flow_threads(name) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not flow_threads(name)


@pytest.mark.parametrize("n", [0, 1, 5])
def test_source_that_raises_names_the_item_it_was_producing(n):
    p = Pipeline(f"src{n}")
    p.chain(
        Source("src", _source_raising_at(n), output_type=int),
        Sink("sink", lambda x: None, input_type=int),
        capacity=2,
    )
    with pytest.raises(StageFailed) as info:
        p.run(timeout=BOUND_S)
    assert info.value.stage == "src" and info.value.item == n
    assert str(info.value).startswith(f"stage 'src' failed on item {n}: ValueError")
    assert isinstance(info.value.__cause__, ValueError)
    _assert_no_threads(f"src{n}")


@pytest.mark.parametrize(
    "workers, ordered", [(1, True), (3, True), (3, False)], ids=["one", "pool", "unordered"]
)
def test_map_that_raises_names_its_item(workers, ordered):
    name = f"map{workers}{ordered}"
    p = Pipeline(name)
    p.chain(
        Source("src", lambda: range(10), output_type=int),
        Map("work", _raise_at(4), input_type=int, workers=workers, ordered=ordered),
        Sink("sink", lambda x: None, input_type=int),
        capacity=2,
    )
    with pytest.raises(StageFailed, match="stage 'work' failed on item 4: ValueError: bad item 4"):
        p.run(timeout=BOUND_S)
    _assert_no_threads(name)


def test_sink_that_raises_names_its_item():
    p = Pipeline("sinkfail")
    p.chain(
        Source("src", lambda: range(10), output_type=int),
        Sink("sink", _raise_at(7), input_type=int),
        capacity=2,
    )
    with pytest.raises(StageFailed, match="stage 'sink' failed on item 7"):
        p.run(timeout=BOUND_S)
    _assert_no_threads("sinkfail")


class _Lifecycle(Stage):
    def __init__(self, name, where):
        super().__init__(name, inputs={"in": int})
        self.where = where

    def open(self):
        if self.where == "open":
            raise OSError("no device")

    def run(self, ctx):
        for _ in ctx.read("in"):
            pass

    def close(self):
        if self.where == "close":
            raise OSError("cannot release")


@pytest.mark.parametrize("where", ["open", "close"])
def test_lifecycle_hooks_that_raise_name_the_stage(where):
    p = Pipeline(f"life{where}")
    p.chain(Source("src", lambda: range(3), output_type=int), _Lifecycle("dev", where), capacity=1)
    with pytest.raises(StageFailed, match="stage 'dev' failed.*OSError") as info:
        p.run(timeout=BOUND_S)
    assert info.value.stage == "dev"
    if where == "close":
        assert "in close()" in str(info.value)
    _assert_no_threads(f"life{where}")


@pytest.mark.parametrize(
    "fn, match",
    [
        (lambda x: None, "stage 'work' put None on port 'out'"),
        (lambda x: str(x), "stage 'work'.*'out'"),
    ],
    ids=["none", "wrong_type"],
)
def test_map_returning_the_wrong_thing_names_stage_and_port(fn, match):
    p = Pipeline("types")
    p.chain(
        Source("src", lambda: range(3), output_type=int),
        Map("work", fn, input_type=int),
        Sink("sink", lambda x: None, input_type=int),
        capacity=1,
    )
    with pytest.raises(StageFailed, match=match) as info:
        p.run(timeout=BOUND_S)
    assert isinstance(info.value.__cause__, TypeError)
    _assert_no_threads("types")


def test_a_stage_past_its_timeout_is_named():
    p = Pipeline("slow")
    p.chain(
        Source("src", lambda: range(3), output_type=int),
        Map("slow", lambda x: time.sleep(1.0) or x, input_type=int, timeout=0.1),
        Sink("sink", lambda x: None, input_type=int),
        capacity=1,
    )
    with pytest.raises(StageFailed, match="stage 'slow' failed on item 0: StageTimeout") as info:
        p.run(timeout=BOUND_S)
    assert isinstance(info.value.__cause__, StageTimeout)
    _assert_no_threads("slow")


def test_run_timeout_and_outside_cancel_join_every_thread():
    def forever():
        while True:
            yield 1

    p = Pipeline("forever")
    p.chain(
        Source("src", forever, output_type=int),
        Map("work", lambda x: time.sleep(0.01) or x, input_type=int, workers=2),
        Sink("sink", lambda x: None, input_type=int),
        capacity=1,
    )
    with pytest.raises(RunTimeout, match="did not finish within 0.3 s"):
        p.run(timeout=0.3)
    _assert_no_threads("forever")
    stop = threading.Event()
    run = p.start(cancel=stop)
    time.sleep(0.1)
    stop.set()
    with pytest.raises(Cancelled):
        run.wait(timeout=BOUND_S)
    _assert_no_threads("forever")


@pytest.mark.parametrize(
    "build, match",
    [
        (
            lambda p: p.chain(
                Source("a", lambda: [], output_type=int),
                Sink("b", print, input_type=str),
                capacity=1,
            ),
            "'a'.*'b'",
        ),
        (
            lambda p: p.chain(
                Source("a", lambda: [], output_type=int),
                Sink("b", print, input_type=int),
                capacity=0,
            ),
            "capacity=0",
        ),
        (
            lambda p: (
                p.add(Sink("a", print, input_type=int)),
                p.add(Sink("a", print, input_type=int)),
            ),
            "'a'",
        ),
        (lambda p: p.add(Sink("alone", print, input_type=int)) and p.check(), "alone"),
    ],
    ids=["port_types", "capacity", "duplicate_name", "unconnected_input"],
)
def test_bad_wiring_is_refused_before_anything_runs(build, match):
    p = Pipeline("wiring")
    with pytest.raises(BuildError, match=match):
        build(p)
        p.check()
    assert not flow_threads("wiring")


# ------------------------------------------------------------------ dew-pipe run: one line
# on stderr and the documented exit status for every bad input (issue 11 item 3 included).

GOOD = (
    "from dew_pipe.flow import Pipeline, Sink, Source\n"
    "def pipeline(n: int = 3):\n"
    "    p = Pipeline('good')\n"
    "    p.chain(Source('src', lambda: range(n), output_type=int),\n"
    "            Sink('sink', lambda x: None, input_type=int), capacity=1)\n"
    "    return p\n"
)


@pytest.fixture
def good_file(tmp_path):
    path = tmp_path / "good.py"
    path.write_text(GOOD)
    return path


def _run_dir_cases(tmp_path):
    (tmp_path / "a_file").write_text("x")
    return {
        "is_a_file": (tmp_path / "a_file", "exists and is not a directory"),
        "under_a_file": (
            tmp_path / "a_file" / "sub",
            "cannot create the directory: Not a directory",
        ),
    }


@pytest.mark.parametrize("case", ["is_a_file", "under_a_file"])
def test_cli_run_dir_that_cannot_be_a_directory(case, good_file, tmp_path):
    path, message = _run_dir_cases(tmp_path)[case]
    result = run_cli("run", good_file, "--run-dir", path)
    assert result.returncode == 2
    line = one_line(result.stderr)
    assert str(path) in line and message in line
    assert (tmp_path / "a_file").read_text() == "x"  # left as it was


BAD_FILES = {
    "syntax_error": ("def pipeline(:\n", "could not load"),
    "raises_on_import": ("raise RuntimeError('no GPU here')\n", "RuntimeError: no GPU here"),
    "nothing_to_run": ("x = 1\n", "defines no `pipeline`"),
    "pipeline_wrong_type": ("pipeline = 3\n", "`pipeline` is a int"),
    "returns_wrong_type": ("def pipeline():\n    return 3\n", "returned a int"),
    "refuses_settings": (
        "def pipeline(n: int = 1):\n    raise ValueError('n must be even')\n",
        "refused its settings: ValueError: n must be even",
    ),
    "unconnected": (
        "from dew_pipe.flow import Pipeline, Sink\n"
        "def pipeline():\n"
        "    p = Pipeline('lonely')\n"
        "    p.add(Sink('sink', print, input_type=int))\n"
        "    return p\n",
        "sink",
    ),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_cli_run_bad_pipeline_files_are_one_line_exit_2(case, tmp_path):
    text, message = BAD_FILES[case]
    path = tmp_path / "bad.py"
    path.write_text(text)
    result = run_cli("run", path, "--run-dir", tmp_path / "run")
    assert result.returncode == 2, result.stderr
    assert message in one_line(result.stderr)
    assert not (tmp_path / "run").exists()  # nothing ran, nothing written


@pytest.mark.parametrize(
    "args, message",
    [
        (["--set", "m=4"], "m"),
        (["--set", "n=four"], "four"),
        (["--set", "n"], "n"),
        (["--metrics-every", "0"], "--metrics-every 0"),
    ],
    ids=["unknown_setting", "bad_value", "no_equals", "metrics_every"],
)
def test_cli_run_bad_settings_are_one_line_exit_2(args, message, good_file, tmp_path):
    result = run_cli("run", good_file, "--run-dir", tmp_path / "run", *args)
    assert result.returncode == 2
    assert message in one_line(result.stderr)


@pytest.mark.parametrize(
    "args, message",
    [(["missing.py"], "no such file"), (["notes.txt"], "expected a Python file")],
    ids=["missing", "not_python"],
)
def test_cli_run_bad_paths(args, message, tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    result = run_cli("run", *args, cwd=tmp_path)
    assert result.returncode == 2
    assert message in one_line(result.stderr)


def test_cli_run_failing_stage_exits_1_naming_stage_and_item(tmp_path):
    path = tmp_path / "fails.py"
    path.write_text(
        "from dew_pipe.flow import Pipeline, Sink, Source\n"
        "def boom(x):\n"
        "    if x == 2:\n"
        "        raise ValueError('bad record 2')\n"
        "pipeline = Pipeline('fails')\n"
        "pipeline.chain(Source('src', lambda: range(5), output_type=int),\n"
        "               Sink('sink', boom, input_type=int), capacity=1)\n"
    )
    result = run_cli("run", path, "--run-dir", tmp_path / "run")
    assert result.returncode == 1
    assert one_line(result.stderr) == (
        "dew-pipe: stage 'sink' failed on item 2: ValueError: bad record 2"
    )
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["status"] == "failed" and "bad record 2" in record["error"]


def test_cli_without_a_command_prints_usage_and_exits_2():
    result = run_cli()
    assert result.returncode == 2 and "usage" in result.stderr


@pytest.fixture(scope="module", autouse=True)
def children_before_this_module():
    """This process's children when the module's first test starts.

    Fixtures of earlier test modules (a rollout server in its own process, say) may still
    run when these tests do; only a child these cases started counts as left behind.
    """
    return set(child_pids())


def test_no_child_process_is_left_by_the_cli_cases(children_before_this_module):
    assert set(child_pids()) - children_before_this_module == set()
