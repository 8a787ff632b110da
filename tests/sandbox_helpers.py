"""Programs and process checks shared by the sandbox tests (test_fleet, test_launch, and the
rewards and code task on bubblewrap).

Hostile programs are Python source run by the sandbox's own ``python3``; "nothing left
running" is checked from outside, by pid (`alive`) or by a marker in the command line that
every fork of a program inherits (`marked`).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

from dew_pipe.sandbox import Program, SandboxLimits
from dew_pipe.sandbox.launch import minimal_environment

ROOT = os.geteuid() == 0
# Programs run as an unprivileged uid under root, which may not read the test's own Python
# (a pyenv build under /root); the system's python3 on the sandbox PATH serves everywhere.
PY = shutil.which("python3", path=minimal_environment("/")["PATH"]) or sys.executable


def py(code: str, *args: str, stdin: str | bytes = b"", **files: str) -> Program:
    """A Python program: ``code`` as main.py, run with ``args``."""
    return Program({"main.py": textwrap.dedent(code), **files}, [PY, "main.py", *args], stdin)


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return handle.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def marked(marker: str) -> list[int]:
    """Pids of live processes whose command line holds ``marker``."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            try:
                if marker.encode() in Path(f"/proc/{name}/cmdline").read_bytes() and alive(
                    int(name)
                ):
                    found.append(int(name))
            except OSError:
                continue
    return found


def wait_until(predicate, seconds: float = 5.0) -> bool:
    """Polls ``predicate`` until it holds or ``seconds`` pass; its last answer."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def shared_folder() -> Iterator[Path]:
    """A folder the program's own uid can write (pytest's tmp_path sits in a private one)."""
    folder = Path(tempfile.mkdtemp(prefix="dew-fleet-test-"))
    folder.chmod(0o777)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


FORKED_CHILD = """
import os, time
pid = os.fork()
if pid == 0:
    time.sleep(60)
    os._exit(0)
print(pid, flush=True)
time.sleep(60)
"""

DAEMONS = """
import os, sys, time
def daemon(close_pipes):
    if os.fork():
        return
    os.setsid()  # out of the program's session and process group
    if os.fork():
        os._exit(0)  # the grandchild is orphaned: a classic double-fork daemon
    print(os.getpid(), flush=True)
    if close_pipes:
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
    time.sleep(60)
    os._exit(0)
daemon(False)
daemon(True)
time.sleep(0.5)
"""

FORK_BOMB = """
import os, sys
marker = sys.argv[1]
print(os.getuid(), flush=True)
while True:
    try:
        os.fork()
    except OSError:
        pass
"""


def fork_bomb_limits() -> SandboxLimits:
    """Short and small: a fork bomb meets its process limit within the deadline."""
    return SandboxLimits(wall_seconds=2, processes=16, memory_bytes=256 * 2**20)


def bubblewrap_runner():
    """A `BubblewrapRunner`; skips where bwrap cannot sandbox, except under CI (``CI`` set),
    where the isolating runner must be tested for real and a missing one fails the test."""
    import pytest

    from dew_pipe.sandbox import BubblewrapRunner, SandboxError

    try:
        return BubblewrapRunner()
    except SandboxError as error:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(error))
