"""What a sandbox runs and what comes back: `Program`, `SandboxLimits`, `Verdict`, `Outcome`.

A `Program` is files, an argv and its stdin; the fleet writes the files into a fresh
temporary directory and a runner executes the argv there, without a shell. `SandboxLimits`
bounds one run; every runner applies all of its fields, each by its own means (rlimits and a
wall clock for processes; the engine's flags for containers). An `Outcome` is what one run
ended as; a program that fails, hangs, crashes or floods its output is an Outcome like any
other. `SandboxError` is the one exception: the sandbox itself could not run the program (a
missing runtime, an engine that refused to start), which a verifier should report as an
infrastructure failure rather than as the program's fault.

Example:
    >>> program = Program({"main.py": "print(input()[::-1])"}, ["python3", "main.py"], "abc")
    >>> sorted(program.files), program.stdin
    (['main.py'], b'abc')
    >>> Outcome(Verdict.COMPLETED, 0, b"cba\\n", b"", 0.02).text
    'cba\\n'
"""

from __future__ import annotations

import enum
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import PurePosixPath

from dew_pipe._validate import check_float, check_int

__all__ = ["Outcome", "Program", "SandboxError", "SandboxLimits", "Verdict"]


class SandboxError(RuntimeError):
    """The sandbox could not run a program at all (not the program's own failure)."""


@dataclass(frozen=True)
class SandboxLimits:
    """The bounds of one run.

    Args:
      cpu_seconds: CPU time (RLIMIT_CPU, rounded up to whole seconds; SIGXCPU then SIGKILL a
        second later). Ends as `Verdict.TIMEOUT`.
      memory_bytes: address space (RLIMIT_AS) or the container's memory. An allocation past it
        fails inside the program (Python raises MemoryError).
      wall_seconds: wall-clock deadline from the start; the whole process tree is killed then
        (`Verdict.TIMEOUT`).
      output_bytes: stdout and stderr together; the tree is killed once more arrives
        (`Verdict.OUTPUT_LIMIT`) and the first ``output_bytes`` are kept.
      processes: processes (and threads) the program may have at once; a fork bomb stops
        there.

    Raises:
      TypeError / ValueError: a field of the wrong type or out of range, named.
    """

    cpu_seconds: float = 5.0
    memory_bytes: int = 512 * 2**20
    wall_seconds: float = 10.0
    output_bytes: int = 2**20
    processes: int = 64

    def __post_init__(self) -> None:
        check = object.__setattr__
        check(self, "cpu_seconds", check_float("cpu_seconds", self.cpu_seconds, above=0.0))
        check(self, "memory_bytes", check_int("memory_bytes", self.memory_bytes, minimum=2**20))
        check(self, "wall_seconds", check_float("wall_seconds", self.wall_seconds, above=0.0))
        check(self, "output_bytes", check_int("output_bytes", self.output_bytes, minimum=1))
        check(self, "processes", check_int("processes", self.processes, minimum=1))

    @property
    def cpu_rlimit(self) -> tuple[int, int]:
        """RLIMIT_CPU as (soft, hard): SIGXCPU at the soft limit, SIGKILL one second later."""
        soft = max(1, math.ceil(self.cpu_seconds))
        return soft, soft + 1


def _relative(name: object) -> str:
    if not isinstance(name, str):
        raise TypeError(f"Program file name {name!r} is a {type(name).__name__}; expected a str")
    path = PurePosixPath(name)
    if (
        not name
        or "\0" in name
        or path.is_absolute()
        or ".." in path.parts
        or str(path) in ("", ".")
    ):
        raise ValueError(
            f"Program file name {name!r} is not a relative path inside the job directory"
        )
    return str(path)


@dataclass(frozen=True)
class Program:
    """Files written into a fresh directory, an argv run there without a shell, and its stdin.

    Args:
      files: relative path -> contents (str is written as UTF-8). Folders are created.
      argv: the command; ``argv[0]`` is looked up on the sandbox's minimal PATH
        (``/usr/local/bin:/usr/bin:/bin``) unless it contains a slash.
      stdin: bytes fed to the program (str is encoded as UTF-8); then stdin is closed.

    Raises:
      TypeError / ValueError: an empty argv, a non-str argument, a file name that is absolute
        or climbs out with ``..``, contents that are neither str nor bytes.
    """

    files: Mapping[str, str | bytes]
    argv: Sequence[str]
    stdin: str | bytes = b""
    _encoded: dict[str, bytes] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.files, Mapping):
            raise TypeError(f"Program files is a {type(self.files).__name__}; expected a mapping")
        encoded: dict[str, bytes] = {}
        for name, contents in self.files.items():
            if isinstance(contents, str):
                contents = contents.encode()
            elif not isinstance(contents, bytes):
                raise TypeError(
                    f"Program file {name!r} holds a {type(contents).__name__}; expected str or bytes"
                )
            encoded[_relative(name)] = contents
        if isinstance(self.argv, str | bytes) or not isinstance(self.argv, Sequence):
            raise TypeError(f"Program argv is {self.argv!r}; expected a sequence of str")
        argv = tuple(self.argv)
        if not argv:
            raise ValueError("Program argv is empty; expected at least the command")
        for arg in argv:
            if not isinstance(arg, str) or "\0" in arg:
                raise TypeError(f"Program argv holds {arg!r}; expected str without NUL")
        stdin = self.stdin.encode() if isinstance(self.stdin, str) else self.stdin
        if not isinstance(stdin, bytes):
            raise TypeError(f"Program stdin is a {type(stdin).__name__}; expected str or bytes")
        object.__setattr__(self, "argv", argv)
        object.__setattr__(self, "stdin", stdin)
        object.__setattr__(self, "_encoded", encoded)

    def write(self, directory: str) -> None:
        """Writes the files under ``directory`` (which must exist)."""
        for name, contents in self._encoded.items():
            path = os.path.join(directory, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as handle:
                handle.write(contents)


class Verdict(enum.Enum):
    """How a run ended."""

    COMPLETED = "completed"  # exited 0
    FAILED = "failed"  # exited non-zero (including a command that could not be started: 127)
    TIMEOUT = "timeout"  # past the wall deadline or the CPU-time limit
    CRASHED = "crashed"  # killed by a signal of its own making (SIGSEGV, SIGABRT, ...)
    OUTPUT_LIMIT = "output_limit"  # wrote more than output_bytes


@dataclass(frozen=True)
class Outcome:
    """What one run ended as.

    Args:
      verdict: see `Verdict`.
      exit_code: the exit status, or None when a signal ended it (or the sandbox did).
      stdout, stderr: what it wrote, at most ``output_bytes`` together.
      seconds: wall time from start to the last process gone.
      signal: the signal that ended it, where one did.
    """

    verdict: Verdict
    exit_code: int | None
    stdout: bytes
    stderr: bytes
    seconds: float
    signal: int | None = None

    @property
    def text(self) -> str:
        """stdout decoded as UTF-8 (undecodable bytes replaced)."""
        return self.stdout.decode("utf-8", errors="replace")

    @property
    def ok(self) -> bool:
        """The program exited 0 within its limits."""
        return self.verdict is Verdict.COMPLETED
