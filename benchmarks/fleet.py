"""SandboxFleet: programs per second at 1, 2 and 4 workers, and the hostile-program suite.

Throughput: ``--programs`` small Python programs (read a line, print it reversed) through a
fleet of each runner, against the same programs started one after another with a bare
``subprocess.run`` (no limits, no supervisor), measured in the same run. The hostile suite
runs programs that hang, spin, allocate without end, flood their output, crash, fork a child,
daemonize with ``setsid`` or fork-bomb; each gets its expected verdict or is counted wrong,
and every process still alive afterwards whose command line carries the run's marker (every
forked process inherits it) is counted as leaked.

Example:
    .venv/bin/python benchmarks/fleet.py --programs 48
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
import textwrap
import time
from pathlib import Path

from machine import print_machine

from dew_pipe.sandbox import (
    BubblewrapRunner,
    ProcessRunner,
    Program,
    SandboxError,
    SandboxFleet,
    SandboxLimits,
    Verdict,
)
from dew_pipe.sandbox.launch import minimal_environment

PY = shutil.which("python3", path=minimal_environment("/")["PATH"]) or "python3"
ECHO = "print(input()[::-1])"

HOSTILE = {  # name -> (code, expected verdict)
    "completes": ("print('ok')", Verdict.COMPLETED),
    "exit_code": ("raise SystemExit(2)", Verdict.FAILED),
    "sleeps": ("import time; time.sleep(60)", Verdict.TIMEOUT),
    "cpu_spin": ("while True: pass", Verdict.TIMEOUT),
    "memory_bomb": ("b = []\nwhile True: b.append(bytearray(2**26))", Verdict.FAILED),
    "output_flood": ("while True: print('x' * 4096)", Verdict.OUTPUT_LIMIT),
    "segfault": ("import ctypes; ctypes.string_at(0)", Verdict.CRASHED),
    "abort": ("import os; os.abort()", Verdict.CRASHED),
    "forked_child": (
        "import os, time\nif os.fork() == 0: time.sleep(60)\ntime.sleep(60)",
        Verdict.TIMEOUT,
    ),
    "setsid_daemon": (
        """
        import os, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                null = os.open(os.devnull, os.O_RDWR)
                for fd in (0, 1, 2):
                    os.dup2(null, fd)
                time.sleep(60)
            os._exit(0)
        """,
        Verdict.COMPLETED,
    ),
    "fork_bomb": (
        "import os\nwhile True:\n    try: os.fork()\n    except OSError: pass",
        Verdict.TIMEOUT,
    ),
}
HOSTILE_LIMITS = SandboxLimits(
    cpu_seconds=1, memory_bytes=256 * 2**20, wall_seconds=3, output_bytes=2**16, processes=32
)


def _marked(marker: str) -> int:
    count = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if marker.encode() in Path(f"/proc/{name}/cmdline").read_bytes():
                    state = Path(f"/proc/{name}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
                    count += state != b"Z"
            except OSError:
                continue
    return count


def _runners() -> dict[str, object]:
    runners: dict[str, object] = {"ProcessRunner": ProcessRunner()}
    try:
        runners["BubblewrapRunner"] = BubblewrapRunner()
    except SandboxError as exc:
        print(f"BubblewrapRunner skipped: {exc}")
    return runners


def throughput(runners: dict[str, object], programs: int) -> None:
    program = Program({"main.py": ECHO}, [PY, "main.py"], "abc\n")
    with tempfile.TemporaryDirectory() as job:
        program.write(job)
        start = time.monotonic()
        for _ in range(programs):
            subprocess.run(program.argv, cwd=job, input=b"abc\n", capture_output=True, check=True)
        bare = programs / (time.monotonic() - start)
    print(f"\nbare subprocess.run, one at a time: {bare:.1f} programs/s")
    print("| runner | workers | programs/s | vs bare |\n|---|---:|---:|---:|")
    for name, runner in runners.items():
        for workers in (1, 2, 4):
            with SandboxFleet(runner, SandboxLimits(), workers=workers) as fleet:
                start = time.monotonic()
                outcomes = fleet.run([program] * programs)
                rate = programs / (time.monotonic() - start)
            assert all(o.text == "cba\n" for o in outcomes), outcomes[0]
            print(f"| {name} | {workers} | {rate:.1f} | {rate / bare:.2f}× |")


def hostile(runners: dict[str, object]) -> None:
    print("\n| runner | programs | verdicts right | leaked processes | wall s |")
    print("|---|---:|---:|---:|---:|")
    for name, runner in runners.items():
        marker = f"dew-hostile-{os.getpid()}-{name}"
        programs = [
            Program({"main.py": textwrap.dedent(code)}, [PY, "main.py", marker])
            for code, _ in HOSTILE.values()
        ]
        with SandboxFleet(runner, HOSTILE_LIMITS, workers=len(programs)) as fleet:
            start = time.monotonic()
            outcomes = fleet.run(programs)
            wall = time.monotonic() - start
        right = 0
        for (label, (_, expected)), outcome in zip(HOSTILE.items(), outcomes, strict=True):
            if outcome.verdict is expected:
                right += 1
            else:
                print(f"  {name} {label}: {outcome.verdict.name}, expected {expected.name}")
        print(f"| {name} | {len(programs)} | {right} | {_marked(marker)} | {wall:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--programs", type=int, default=48, help="programs per throughput row")
    args = parser.parse_args()
    runners = _runners()
    print(f"uid {os.geteuid()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}, {PY}")
    throughput(runners, args.programs)
    hostile(runners)


if __name__ == "__main__":
    print_machine()
    main()
