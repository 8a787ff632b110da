"""Shared by the fault suite (tests/test_faults*.py): run a case in a child process with a
deadline, and check what a failure leaves behind (threads, child processes, files).

A case that could hang runs in its own process: a hang then fails the test at the deadline
instead of stalling the suite, and "the process exits" is itself what is checked (a stuck
non-daemon thread keeps a process alive after its main thread returns).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEADLINE_S = 30.0  # generous for a loaded 2-core machine; the cases themselves take ~1 s


def run_python(
    code: str, *args: str, deadline: float = DEADLINE_S, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """Run ``code`` (dedented) in a fresh interpreter; fail if it outlives ``deadline``.

    JAX is kept to one CPU device and no preallocation, in case a case imports it.
    """
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    try:
        return subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code), *args],
            capture_output=True,
            text=True,
            timeout=deadline,
            cwd=cwd,
            env=env,
        )
    except subprocess.TimeoutExpired as e:  # subprocess.run has killed it
        raise AssertionError(
            f"the process did not exit within {deadline} s (a thread kept it alive?); "
            f"stdout: {e.stdout!r} stderr: {e.stderr!r}"
        ) from None


def run_cli(*args: str, deadline: float = DEADLINE_S, cwd: Path | None = None):
    """``dew-pipe ARGS`` in a child process (``python -m dew_pipe.cli``), with a deadline."""
    return run_python(
        "import sys; from dew_pipe.cli import main; sys.exit(main(sys.argv[1:]))",
        *map(str, args),
        deadline=deadline,
        cwd=cwd,
    )


def one_line(stderr: str) -> str:
    """The single line a command printed on stderr (fails if there are more or none)."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{stderr}"
    assert "Traceback" not in lines[0]
    return lines[0]


def flow_threads(pipeline: str) -> list[threading.Thread]:
    """Threads of the flow run of ``pipeline`` still alive in this process."""
    return [t for t in threading.enumerate() if t.name.startswith(f"flow:{pipeline}:")]


def child_pids() -> list[int]:
    """Live child processes of this process (from /proc; no psutil)."""
    me = str(os.getpid())
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me and fields[0] != "Z":  # fields: state, ppid, ...
            children.append(int(entry.name))
    return children


def files_under(folder: Path) -> list[str]:
    """Every path under ``folder`` (hidden ones too), relative, sorted; [] if it is absent."""
    if not folder.exists():
        return []
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))
