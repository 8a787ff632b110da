"""The sandbox fleet with real programs: every verdict, escapes, parent death, isolation.

Each hostile program runs for real under the limits, and "nothing left running" is checked
from outside: by the pids a program reports, or by a marker in the command line of every
process a fork bomb made. Timed programs of one kind run together through one fleet
(module-scoped fixtures), so the deadlines overlap and the file stays fast.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from sandbox_helpers import (
    DAEMONS,
    FORK_BOMB,
    FORKED_CHILD,
    ROOT,
    alive,
    bubblewrap_runner,
    fork_bomb_limits,
    marked,
    py,
    shared_folder,
    wait_until,
)

from dew_pipe.sandbox import (
    BubblewrapRunner,
    ContainerRunner,
    Outcome,
    ProcessRunner,
    Program,
    SandboxError,
    SandboxFleet,
    SandboxLimits,
    Verdict,
)

shared_dir = pytest.fixture(shared_folder)


# -- values ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"cpu_seconds": 0}, ValueError, "cpu_seconds is 0"),
        ({"wall_seconds": float("inf")}, ValueError, "wall_seconds"),
        ({"memory_bytes": 1000}, ValueError, "memory_bytes is 1000; expected an int >= 1048576"),
        ({"processes": "8"}, TypeError, "processes is '8'"),
        ({"output_bytes": True}, TypeError, "output_bytes"),
    ],
)
def test_limits_refuse_bad_values(kwargs, error, words):
    with pytest.raises(error, match=words):
        SandboxLimits(**kwargs)


def test_limits_cpu_rlimit_rounds_up():
    assert SandboxLimits(cpu_seconds=1.2).cpu_rlimit == (2, 3)
    assert SandboxLimits(cpu_seconds=0.1).cpu_rlimit == (1, 2)


@pytest.mark.parametrize(
    ("args", "error", "words"),
    [
        (({"/etc/passwd": "x"}, ["true"]), ValueError, "'/etc/passwd' is not a relative path"),
        (({"a/../../x": "x"}, ["true"]), ValueError, "'a/../../x'"),
        (({"a": 3}, ["true"]), TypeError, "file 'a' holds a int"),
        (({}, []), ValueError, "argv is empty"),
        (({}, "python3 x.py"), TypeError, "argv is 'python3 x.py'"),
        (({}, ["true", None]), TypeError, "argv holds None"),
        (({}, ["true"], 5), TypeError, "stdin is a int"),
    ],
)
def test_program_refuses_bad_values(args, error, words):
    with pytest.raises(error, match=words):
        Program(*args)


def test_fleet_refuses_bad_arguments():
    with pytest.raises(TypeError, match="expected a Runner"):
        SandboxFleet(object())
    with pytest.raises(ValueError, match="workers is 0; expected an int >= 1"):
        SandboxFleet(ProcessRunner(), workers=0)
    with pytest.raises(TypeError, match="expected a SandboxLimits"):
        SandboxFleet(ProcessRunner(), limits={"wall_seconds": 1})
    with (
        SandboxFleet(ProcessRunner(), workers=1) as fleet,
        pytest.raises(TypeError, match="expected a Program"),
    ):
        fleet.submit(["echo", "hi"])
    with pytest.raises(RuntimeError, match="shut down"):
        fleet.submit(Program({}, ["true"]))


# -- every verdict, through one fleet -----------------------------------------------------

LIMITS = SandboxLimits(cpu_seconds=1, memory_bytes=256 * 2**20, wall_seconds=3, output_bytes=10_000)

HOSTILE = {
    "round_trip": py(
        """
        import sys
        from lib.util import shout
        data = sys.stdin.read()
        print(shout(data[::-1]))
        print("to stderr", file=sys.stderr)
        """,
        stdin="héllo",
        **{"lib/__init__.py": "", "lib/util.py": "def shout(s):\n    return s.upper()\n"},
    ),
    "exit_3": py("raise SystemExit(3)"),
    "exception": py("raise ValueError('boom')"),
    "no_such_command": Program({}, ["dew-no-such-command"]),
    "sleep": py("import time; print('started', flush=True); time.sleep(60)"),
    "memory_bomb": py("blocks = []\nwhile True: blocks.append(bytearray(64 * 2**20))"),
    "output_flood": py("import sys\nwhile True: sys.stdout.write('x' * 4096)"),
    "stderr_flood": py("import sys\nwhile True: sys.stderr.write('y' * 4096)"),
    "abort": py("import os; os.abort()"),
    "segfault": py("import ctypes; ctypes.string_at(0)"),
    "stdin_ignored": py("print('not reading')", stdin=b"z" * (1 << 20)),
    "broken_pipe": Program({}, ["sh", "-c", "yes | head -n 1"]),
}


@pytest.fixture(scope="module")
def hostile() -> dict[str, Outcome]:
    with SandboxFleet(ProcessRunner(), LIMITS, workers=len(HOSTILE)) as fleet:
        return dict(zip(HOSTILE, fleet.run(HOSTILE.values()), strict=True))


def test_round_trip(hostile):
    outcome = hostile["round_trip"]
    assert outcome.verdict is Verdict.COMPLETED and outcome.exit_code == 0
    assert outcome.text == "OLLÉH\n" and outcome.stderr == b"to stderr\n"
    assert outcome.signal is None and 0 < outcome.seconds < 3


@pytest.mark.parametrize(
    ("name", "code", "words"),
    [
        ("exit_3", 3, b""),
        ("exception", 1, b"ValueError: boom"),
        ("no_such_command", 127, b"cannot execute 'dew-no-such-command'"),
    ],
)
def test_failures_keep_their_exit_code(hostile, name, code, words):
    outcome = hostile[name]
    assert (outcome.verdict, outcome.exit_code, outcome.signal) == (Verdict.FAILED, code, None)
    assert words in outcome.stderr


def test_sleep_past_the_wall_deadline(hostile):
    outcome = hostile["sleep"]
    assert outcome.verdict is Verdict.TIMEOUT and outcome.exit_code is None
    assert outcome.text == "started\n"  # output before the deadline is kept
    assert 3 <= outcome.seconds < 6


def test_cpu_spin_stops_at_the_cpu_limit():
    spin = py("while True: pass")
    stubborn = py("import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True: pass")
    limits = SandboxLimits(cpu_seconds=1, wall_seconds=20)
    with SandboxFleet(ProcessRunner(), limits, workers=2) as fleet:
        spun, ignored = fleet.run([spin, stubborn])
    # Ended by RLIMIT_CPU long before the wall deadline: SIGXCPU at 1 s of CPU time, and
    # SIGKILL a second later for a program that ignores SIGXCPU.
    assert (spun.verdict, spun.signal) == (Verdict.TIMEOUT, signal.SIGXCPU)
    assert (ignored.verdict, ignored.signal) == (Verdict.TIMEOUT, signal.SIGKILL)
    assert spun.seconds < 15 and ignored.seconds < 15


def test_memory_bomb_fails_inside_its_address_space(hostile):
    outcome = hostile["memory_bomb"]
    assert (outcome.verdict, outcome.exit_code) == (Verdict.FAILED, 1)
    assert b"MemoryError" in outcome.stderr


@pytest.mark.parametrize("name", ["output_flood", "stderr_flood"])
def test_output_flood_is_cut_at_the_cap(hostile, name):
    outcome = hostile[name]
    assert outcome.verdict is Verdict.OUTPUT_LIMIT
    assert len(outcome.stdout) + len(outcome.stderr) == LIMITS.output_bytes
    assert outcome.seconds < 3


@pytest.mark.parametrize(("name", "sig"), [("abort", signal.SIGABRT), ("segfault", signal.SIGSEGV)])
def test_crashes_name_their_signal(hostile, name, sig):
    outcome = hostile[name]
    assert (outcome.verdict, outcome.exit_code, outcome.signal) == (Verdict.CRASHED, None, sig)


def test_default_signal_dispositions(hostile):
    """SIGPIPE is not left ignored: ``yes`` dies quietly when ``head`` has had enough."""
    outcome = hostile["broken_pipe"]
    assert (outcome.verdict, outcome.text, outcome.stderr) == (Verdict.COMPLETED, "y\n", b"")


def test_unread_stdin_is_no_failure(hostile):
    assert hostile["stdin_ignored"].verdict is Verdict.COMPLETED
    assert hostile["stdin_ignored"].text == "not reading\n"


# -- nothing outlives its outcome --------------------------------------------------------

FORK_COUNT = """
import os, time
made = 0
for _ in range(200):
    try:
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        made += 1
    except OSError:
        break
print(made)
"""


@pytest.fixture(scope="module")
def escapes() -> dict[str, Outcome]:
    marker = f"dew-fork-bomb-{os.getpid()}"
    programs = {
        "forked_child": py(FORKED_CHILD),
        "daemons": py(DAEMONS),
        "fork_bomb": py(FORK_BOMB, marker),
        "fork_count": py(FORK_COUNT),
    }
    # Not as root, every program shares the caller's uid and so its RLIMIT_NPROC count: they
    # then run one at a time, so that one's forks do not starve another's.
    batches = [programs] if ROOT else [{name: program} for name, program in programs.items()]
    outcomes = {}
    for batch in batches:
        with SandboxFleet(ProcessRunner(), fork_bomb_limits(), workers=len(batch)) as fleet:
            outcomes.update(zip(batch, fleet.run(batch.values()), strict=True))
    outcomes["marker"] = marker
    return outcomes


def test_forked_child_dies_at_the_deadline(escapes):
    outcome = escapes["forked_child"]
    assert outcome.verdict is Verdict.TIMEOUT
    assert not alive(int(outcome.text))


def test_setsid_escapees_and_daemons_do_not_survive(escapes):
    outcome = escapes["daemons"]
    assert outcome.verdict is Verdict.COMPLETED  # the program itself exited 0 at once
    pids = [int(line) for line in outcome.text.split()]
    assert len(pids) == 2 and not any(alive(pid) for pid in pids)
    assert outcome.seconds < 2  # the one that closed its pipes did not hold the run open


def test_fork_bomb_is_contained_and_swept(escapes):
    outcome = escapes["fork_bomb"]
    assert outcome.verdict is Verdict.TIMEOUT
    assert marked(escapes["marker"]) == []
    if ROOT:  # run under an unprivileged uid of its own, where RLIMIT_NPROC binds
        assert int(outcome.text.split()[0]) >= 65000


def test_process_count_is_bounded(escapes):
    made = int(escapes["fork_count"].text)
    assert made < fork_bomb_limits().processes  # the program itself is one of them
    if ROOT:  # its own uid: the allowance is all its own (otherwise the concurrent fork bomb
        assert made >= 10  # shares the caller's uid, hence its RLIMIT_NPROC count)


def test_parent_killed_while_a_program_runs(shared_dir):
    """SIGKILL the process that owns the fleet: its program and a daemonized child die."""
    program = py(
        """
        import os, sys, time
        folder = sys.argv[1]
        if os.fork() == 0:
            os.setsid()
            open(os.path.join(folder, "escapee"), "w").write(str(os.getpid()))
            time.sleep(60)
            os._exit(0)
        open(os.path.join(folder, "program"), "w").write(str(os.getpid()))
        time.sleep(60)
        """,
        str(shared_dir),
    )
    script = textwrap.dedent(
        f"""
        import pickle, sys, time
        from dew_pipe.sandbox import ProcessRunner, SandboxFleet, SandboxLimits
        fleet = SandboxFleet(ProcessRunner(), SandboxLimits(wall_seconds=60), workers=1)
        fleet.submit(pickle.loads({pickle.dumps(program)!r}))
        time.sleep(60)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script])
    try:
        files = [shared_dir / "program", shared_dir / "escapee"]
        assert wait_until(lambda: all(f.exists() and f.read_text() for f in files), 20)
        pids = [int(f.read_text()) for f in files]
        assert all(alive(pid) for pid in pids)
        parent.kill()
        parent.wait()
        assert wait_until(lambda: not any(alive(pid) for pid in pids), 5), pids
    finally:
        parent.kill()
        parent.wait()


# -- environment, parallelism, the kept-alive launcher -------------------------------------


def test_parent_environment_is_invisible(monkeypatch):
    monkeypatch.setenv("DEW_TEST_SECRET", "hunter2")
    program = py("import json, os; print(json.dumps(dict(os.environ)))")
    with SandboxFleet(ProcessRunner(), workers=1) as fleet:
        outcome = fleet.submit(program).result()
    seen = json.loads(outcome.text)
    assert "DEW_TEST_SECRET" not in seen and "hunter2" not in outcome.text
    assert set(seen) <= {"PATH", "LANG", "HOME", "TMPDIR", "PYTHONDONTWRITEBYTECODE", "LC_CTYPE"}


LIMITS_INSIDE = """
import json, os, resource
print(json.dumps({
    "core": resource.getrlimit(resource.RLIMIT_CORE),
    "cpu": resource.getrlimit(resource.RLIMIT_CPU),
    "address_space": resource.getrlimit(resource.RLIMIT_AS),
    "session_leader": os.getsid(0) == os.getpid(),
    "group_leader": os.getpgid(0) == os.getpid(),
}))
"""


@pytest.mark.parametrize("runner", ["process", "bubblewrap"])
def test_limits_as_the_program_sees_them(runner):
    """No core dumps, the CPU and address-space limits asked for, a session of its own."""
    limits = SandboxLimits(cpu_seconds=2.5, memory_bytes=300 * 2**20, wall_seconds=10)
    chosen = ProcessRunner() if runner == "process" else bubblewrap_runner()
    with SandboxFleet(chosen, limits, workers=1) as fleet:
        outcome = fleet.submit(py(LIMITS_INSIDE)).result()
    assert outcome.verdict is Verdict.COMPLETED, outcome.stderr.decode()
    seen = json.loads(outcome.text)
    assert seen["core"] == [0, 0]
    assert seen["cpu"] == list(limits.cpu_rlimit) == [3, 4]
    assert seen["address_space"] == [limits.memory_bytes] * 2
    if runner == "process":  # under bwrap the session is bwrap's (--new-session), inside it
        assert seen["session_leader"] and seen["group_leader"]


def test_workers_run_in_parallel():
    program = py("import time; time.sleep(1); print('done')")
    with SandboxFleet(ProcessRunner(), SandboxLimits(wall_seconds=10), workers=4) as fleet:
        start = time.monotonic()
        outcomes = fleet.run([program] * 4)
        elapsed = time.monotonic() - start
    assert [o.text for o in outcomes] == ["done\n"] * 4
    assert elapsed < 2.5  # one after another would take 4 s


def test_sandbox_error_reaches_the_future():
    class Broken:
        def run(self, program, limits, directory):
            raise SandboxError("no engine")

    with (
        SandboxFleet(Broken(), workers=1) as fleet,
        pytest.raises(SandboxError, match="no engine"),
    ):
        fleet.submit(Program({}, ["true"])).result()


# -- bubblewrap --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bwrap() -> BubblewrapRunner:
    return bubblewrap_runner()


ISOLATION = """
import errno, json, os, socket
def attempt(action):
    try:
        action()
        return "ok"
    except OSError as exc:
        return errno.errorcode[exc.errno]
def write(path):
    with open(path, "w") as handle:
        handle.write("x")
def connect():
    socket.create_connection(("1.1.1.1", 53), timeout=2).close()
def listing(path):
    try:
        return os.listdir(path)
    except FileNotFoundError:
        return []
    except OSError as exc:
        return errno.errorcode[exc.errno]
write("/tmp/scratch")
print(json.dumps({
    "interfaces": [name for _, name in socket.if_nameindex()],
    "connect": attempt(connect),
    "write_usr": attempt(lambda: write("/usr/dew-sandbox-probe")),
    "write_job": attempt(lambda: write("new-file")),
    "read_job": open("data.txt").read(),
    "tmp": open("/tmp/scratch").read(),
    "cwd": os.getcwd(),
    "pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()),
    "root_listing": listing("/root"),
    "secret": os.environ.get("DEW_TEST_SECRET"),
}))
"""


def test_bubblewrap_isolates(bwrap, monkeypatch):
    monkeypatch.setenv("DEW_TEST_SECRET", "hunter2")
    program = py(ISOLATION, **{"data.txt": "job data"})
    with SandboxFleet(bwrap, SandboxLimits(wall_seconds=10), workers=1) as fleet:
        outcome = fleet.submit(program).result()
    assert outcome.verdict is Verdict.COMPLETED, outcome.stderr.decode()
    seen = json.loads(outcome.text)
    assert seen["interfaces"] == ["lo"] and seen["connect"] == "ENETUNREACH"
    assert seen["write_usr"] == "EROFS" and seen["write_job"] == "EROFS"
    assert seen["read_job"] == "job data" and seen["tmp"] == "x"
    assert seen["cwd"] == BubblewrapRunner.WORK
    assert max(seen["pids"]) < 10  # its own pid namespace
    assert seen["root_listing"] == [] and seen["secret"] is None


def test_bubblewrap_verdicts_and_fork_bomb(bwrap):
    marker = f"dew-bwrap-bomb-{os.getpid()}"
    programs = [
        py("print(input()[::-1])", stdin="abc"),
        py("raise SystemExit(4)"),
        py("import os; os.abort()"),
        py(FORKED_CHILD),
        py(FORK_BOMB, marker),
    ]
    with SandboxFleet(bwrap, fork_bomb_limits(), workers=len(programs)) as fleet:
        echo, exit4, abort, forked, bomb = fleet.run(programs)
    assert (echo.verdict, echo.text) == (Verdict.COMPLETED, "cba\n")
    assert (exit4.verdict, exit4.exit_code) == (Verdict.FAILED, 4)
    assert (abort.verdict, abort.signal) == (Verdict.CRASHED, signal.SIGABRT)
    assert forked.verdict is Verdict.TIMEOUT and bomb.verdict is Verdict.TIMEOUT
    assert marked(marker) == []
    assert not marked("dew-sandbox-probe")


# -- containers --------------------------------------------------------------------------


def test_container_command_is_exact():
    runner = ContainerRunner("python:3.12-slim", cpu_shares=256, tmp_bytes=2**24)
    limits = SandboxLimits(cpu_seconds=2.5, memory_bytes=2**28, processes=32)
    command = runner.command(["python", "main.py"], limits, "/tmp/job", "dew-sandbox-x")
    assert command == [
        "docker", "run", "--rm", "--interactive", "--pull", "never",
        "--name", "dew-sandbox-x",
        "--network", "none",
        "--read-only",
        "--tmpfs", "/tmp:rw,nosuid,nodev,size=16777216",
        "--volume", "/tmp/job:/work:ro",
        "--workdir", "/work",
        "--cap-drop", "ALL",
        "--security-opt", "no-new-privileges",
        "--user", "65534:65534",
        "--memory", "268435456",
        "--memory-swap", "268435456",
        "--cpu-shares", "256",
        "--pids-limit", "32",
        "--ulimit", "cpu=3:4",
        "--ulimit", "core=0",
        "--env", "HOME=/tmp",
        "--env", "TMPDIR=/tmp",
        "python:3.12-slim", "python", "main.py",
    ]  # fmt: skip
    assert ContainerRunner("img", runtime="podman").command(["x"], limits, "/j", "n")[0] == "podman"


def test_container_refuses_bad_arguments():
    with pytest.raises(TypeError, match="image is ''"):
        ContainerRunner("")
    with pytest.raises(ValueError, match="cpu_shares is 1"):
        ContainerRunner("img", cpu_shares=1)


FAKE_ENGINE = """#!{python}
# A stand-in for the docker client: 'run' behaves as the container named by --name would,
# 'kill' and 'rm' are recorded.
import os, sys, time
log = os.path.join(os.path.dirname(os.path.abspath(__file__)), "engine.log")
verb = sys.argv[1]
with open(log, "a") as handle:
    handle.write(" ".join(sys.argv[1:]) + "\\n")
if verb == "run":
    command = sys.argv[sys.argv.index("img") + 1:]
    if command == ["hang"]:
        time.sleep(60)
    if command == ["missing-image"]:
        sys.stderr.write("Unable to find image 'img' locally\\n")
        sys.exit(125)
    if command == ["killed"]:
        sys.exit(137)
    sys.stdout.write(sys.stdin.read().upper())
"""


def test_container_is_killed_by_name_at_the_deadline(tmp_path):
    engine = tmp_path / "engine"
    engine.write_text(FAKE_ENGINE.format(python=sys.executable))
    engine.chmod(0o755)
    runner = ContainerRunner("img", runtime=str(engine), startup_seconds=0)
    limits = SandboxLimits(wall_seconds=1)
    with SandboxFleet(runner, limits, workers=3) as fleet:
        hang, echo, killed = fleet.run(
            [Program({}, ["hang"]), Program({}, ["echo"], "abc"), Program({}, ["killed"])]
        )
        with pytest.raises(SandboxError, match="Unable to find image"):
            fleet.submit(Program({}, ["missing-image"])).result()
    assert hang.verdict is Verdict.TIMEOUT
    assert (echo.verdict, echo.text) == (Verdict.COMPLETED, "ABC")
    assert (killed.verdict, killed.signal) == (Verdict.CRASHED, signal.SIGKILL)
    lines = (tmp_path / "engine.log").read_text().splitlines()
    hung = next(line for line in lines if line.startswith("run") and line.endswith(" hang"))
    name = hung.split("--name ")[1].split()[0]
    assert f"kill {name}" in lines and f"rm --force {name}" in lines
    assert sum(line.startswith("kill") for line in lines) == 1  # only the one at its deadline


def _docker_image(image: str) -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        found = subprocess.run(
            ["docker", "image", "inspect", image], capture_output=True, timeout=20, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return found.returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not _docker_image("python:3.12-slim"), reason="no docker with python:3.12-slim")
def test_container_runs_for_real():
    program = py(ISOLATION, **{"data.txt": "job data"})
    program = Program(program.files, ["python", "main.py"])
    runner = ContainerRunner("python:3.12-slim")
    with SandboxFleet(runner, SandboxLimits(wall_seconds=60), workers=1) as fleet:
        outcome = fleet.submit(program).result()
    assert outcome.verdict is Verdict.COMPLETED, outcome.stderr.decode()
    seen = json.loads(outcome.text)
    assert seen["interfaces"] == ["lo"] and seen["connect"] in ("ENETUNREACH", "EAI_AGAIN")
    assert seen["write_usr"] == "EROFS" and seen["write_job"] == "EROFS"
    assert seen["read_job"] == "job data" and seen["cwd"] == "/work"
