"""Sandboxes for untrusted programs: a fleet of runners with limits, and their launcher.

- ``program.py``: `Program` (files, argv, stdin), `SandboxLimits`, `Verdict`, `Outcome`,
  `SandboxError` (the sandbox itself failed; a program's own failure is an Outcome).
- ``launch.py``: the launcher every local runner (and a long-lived tool worker) starts
  processes with: rlimits, a minimal environment, an unprivileged uid under root, and a
  supervisor (``_exec.py``) that leaves no process of a program alive after it.
- ``runners.py``: the `Runner` protocol and its runners: `ProcessRunner` (limits only),
  `BubblewrapRunner` (no network, read-only root, own pid namespace; no daemon needed) and
  `ContainerRunner` (a fresh Docker/Podman container per program).
- ``fleet.py``: `SandboxFleet`, programs on worker threads through one runner.
- ``memo.py``: `MemoFleet`, a fleet that runs each distinct program once and shares its
  Outcome (for deterministic programs graded many times, as an RLVR job's are).

Linux only (prctl, /proc, namespaces). Names resolve lazily, so importing the package stays
cheap.

Example:
    >>> from dew_pipe.sandbox import Program, ProcessRunner, SandboxFleet, SandboxLimits
    >>> with SandboxFleet(ProcessRunner(), SandboxLimits(wall_seconds=5), workers=2) as fleet:
    ...     fleet.submit(Program({}, ["echo", "hi"])).result().text
    'hi\\n'
"""

from __future__ import annotations

from dew_pipe._lazy import lazy_exports

# name -> (module, attribute)
_LAZY: dict[str, tuple[str, str]] = {
    "Program": ("dew_pipe.sandbox.program", "Program"),
    "SandboxLimits": ("dew_pipe.sandbox.program", "SandboxLimits"),
    "Verdict": ("dew_pipe.sandbox.program", "Verdict"),
    "Outcome": ("dew_pipe.sandbox.program", "Outcome"),
    "SandboxError": ("dew_pipe.sandbox.program", "SandboxError"),
    "Runner": ("dew_pipe.sandbox.runners", "Runner"),
    "ProcessRunner": ("dew_pipe.sandbox.runners", "ProcessRunner"),
    "BubblewrapRunner": ("dew_pipe.sandbox.runners", "BubblewrapRunner"),
    "ContainerRunner": ("dew_pipe.sandbox.runners", "ContainerRunner"),
    "SandboxFleet": ("dew_pipe.sandbox.fleet", "SandboxFleet"),
    "MemoFleet": ("dew_pipe.sandbox.memo", "MemoFleet"),
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
