"""SandboxFleet: programs run concurrently on worker threads, each in its own sandbox.

Each submitted `Program` gets a fresh temporary directory with its files; a worker thread
hands it to the fleet's runner, which starts one process tree for it and returns its
`Outcome`; the directory is removed afterwards. A program that fails in any way is an
Outcome; only a sandbox that cannot run at all (`SandboxError`) is raised, from the future.
The workers are a `WorkerPool` (daemon threads), so a process exiting with programs still
running does not wait for them; the runners' supervisors then kill those programs.

Example:
    >>> from dew_pipe.sandbox import ProcessRunner
    >>> programs = [Program({}, ["sh", "-c", f"exit {code}"]) for code in (0, 3)]
    >>> with SandboxFleet(ProcessRunner(), workers=2) as fleet:
    ...     [(o.verdict.name, o.exit_code) for o in fleet.run(programs)]
    [('COMPLETED', 0), ('FAILED', 3)]
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import shutil
import tempfile
from collections.abc import Iterable

from dew_pipe._pool import WorkerPool
from dew_pipe._validate import check_int
from dew_pipe.sandbox.program import Outcome, Program, SandboxLimits
from dew_pipe.sandbox.runners import Runner

__all__ = ["SandboxFleet"]


class SandboxFleet:
    """Runs programs through ``runner`` on ``workers`` threads.

    Args:
      runner: a `Runner` (`ProcessRunner`, `BubblewrapRunner`, `ContainerRunner`).
      limits: the limits of every program.
      workers: programs running at once; default the machine's CPU count.

    Raises:
      TypeError / ValueError: a runner without ``run``, limits that are not `SandboxLimits`,
        workers not an int >= 1.
    """

    def __init__(
        self, runner: Runner, limits: SandboxLimits | None = None, workers: int | None = None
    ) -> None:
        if not callable(getattr(runner, "run", None)):
            raise TypeError(f"runner is {runner!r}; expected a Runner (with a run method)")
        limits = SandboxLimits() if limits is None else limits
        if not isinstance(limits, SandboxLimits):
            raise TypeError(f"limits is {limits!r}; expected a SandboxLimits")
        workers = (os.cpu_count() or 1) if workers is None else workers
        self.runner = runner
        self.limits = limits
        self.workers = check_int("workers", workers, minimum=1)
        self._pool = WorkerPool(self.workers, name="sandbox")

    def submit(self, program: Program) -> cf.Future[Outcome]:
        """Starts ``program`` as soon as a worker is free; returns its future Outcome.

        Raises:
          TypeError: ``program`` is not a `Program`.
          RuntimeError: the fleet is closed.
        """
        if not isinstance(program, Program):
            raise TypeError(f"program is a {type(program).__name__}; expected a Program")
        return self._pool.submit(self._run, program)

    def run(self, programs: Iterable[Program]) -> list[Outcome]:
        """Runs ``programs`` concurrently; their Outcomes in the same order."""
        futures = [self.submit(program) for program in programs]
        return [future.result() for future in futures]

    def _run(self, program: Program) -> Outcome:
        directory = tempfile.mkdtemp(prefix="dew-sandbox-")
        try:
            program.write(directory)
            return self.runner.run(program, self.limits, directory)
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    def close(self) -> None:
        """Stops accepting programs and waits for the running ones (at most their deadline)."""
        self._pool.shutdown(wait=True)

    def __enter__(self) -> SandboxFleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SandboxFleet({self.runner!r}, {self.limits!r}, workers={self.workers})"
