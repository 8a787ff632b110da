"""The process launcher shared by every local sandbox: a supervised process tree with limits.

`Launched` starts ``argv`` under the supervisor of ``_exec.py`` (read its docstring for the
mechanics) and gives the caller the program's stdin/stdout/stderr pipes. `run` drives one
launched program to completion: it feeds stdin, collects output up to a cap, and stops the
tree at the wall deadline or on excess output. A long-lived worker that talks JSON lines (a
tool environment) uses `Launched` directly: `Launched.send` and `Launched.receive_line`
bound each exchange by a deadline and a line-size cap, and `Launched.stop` ends it. Either way
the guarantees are the same:

* its own session and process group; RLIMIT_CPU, RLIMIT_AS, no core dumps, RLIMIT_NPROC;
* a minimal environment: only what the caller passes (`minimal_environment` by default),
  nothing of the caller's own environment;
* SIGKILL for the program when the supervisor dies, and the whole tree killed when the
  launching process dies (the supervisor gets a parent-death signal and sweeps);
* **no process outlives the run**: `stop` and the program's own exit both end with the
  supervisor killing and reaping every process under it, including grandchildren that left
  the process group with ``setsid`` or daemonized, since a child subreaper adopts them.

Why a subreaper and an unprivileged uid rather than a cgroup: the subreaper needs no
privilege and works on every Linux since 3.4, inside containers and CI runners alike, while a
cgroup the library may write is not something it can count on (this development machine, a
VM running everything as root, has writable cgroup v1 controllers and a controller-less v2
mount; an ordinary user or container usually has no delegated cgroup at all). The one thing a
subreaper cannot do is bound a fork bomb; RLIMIT_NPROC does, but it never binds root. So when
the launcher runs as root, each program runs under its own unprivileged uid leased from
`JOB_UIDS` (65000-65533, a range Debian policy reserves and assigns to no one), one uid per
running program on the whole machine (a ``flock`` per uid), which makes RLIMIT_NPROC bind,
keeps two programs from signalling each other, and lets the supervisor kill every process of
the job atomically with ``kill(-1)`` from that uid. The working directory is then handed to
that uid (`give_to`), and the folders above it must be searchable by others (``/tmp`` is).
Not as root, the program keeps the caller's uid and RLIMIT_NPROC is set to the caller's
current task count plus the allowance, so programs running at once share it.

What it does not do: a program keeps the filesystem and network view of its uid (use a
runner that isolates for untrusted code), and a program running under the caller's own uid
could kill its supervisor, after which the processes it had detached are no longer swept.

Example:
    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as cwd:
    ...     done = run(["sh", "-c", "cat; exit 3"], cwd=cwd, limits=SandboxLimits(), stdin=b"hi")
    >>> done.stdout, done.exit_code, done.timed_out
    (b'hi', 3, False)
"""

from __future__ import annotations

import ast
import contextlib
import fcntl
import marshal
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from dew_pipe.sandbox.program import SandboxError, SandboxLimits

__all__ = [
    "JOB_UIDS",
    "Finished",
    "Launched",
    "give_to",
    "lease_uid",
    "minimal_environment",
    "run",
]

#: Uids a root launcher runs programs under, one per running program (Debian: "reserved").
JOB_UIDS = range(65000, 65534)
_SUPERVISOR = str(Path(__file__).with_name("_exec.py"))
_STOP_GRACE = 5.0  # seconds a stopped supervisor gets to sweep before it is killed itself


def minimal_environment(home: str) -> dict[str, str]:
    """The environment a program gets: a PATH, a UTF-8 locale, and HOME/TMPDIR at ``home``."""
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "HOME": home,
        "TMPDIR": home,
        "PYTHONDONTWRITEBYTECODE": "1",
    }


@contextlib.contextmanager
def lease_uid(uids: range = JOB_UIDS) -> Iterator[int]:
    """Holds one uid of ``uids`` that no other program on this machine is running under.

    Each uid has a lock file (``flock``, released when the holder ends, even by a crash) in
    a root-owned folder of the temporary directory.

    Raises:
      SandboxError: every uid is taken, or the lock folder is not root's own.
    """
    folder = Path(tempfile.gettempdir()) / "dew_pipe-sandbox-uids"
    with contextlib.suppress(FileExistsError):
        folder.mkdir(mode=0o700)
    info = os.lstat(folder)
    if info.st_uid != os.geteuid() or not os.path.isdir(folder) or os.path.islink(folder):
        raise SandboxError(f"{folder} is not a folder owned by uid {os.geteuid()}; remove it")
    for uid in uids:
        fd = os.open(folder / str(uid), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            yield uid
        finally:
            os.close(fd)
        return
    raise SandboxError(f"all {len(uids)} sandbox uids {uids.start}-{uids.stop - 1} are in use")


def give_to(directory: str, uid: int) -> None:
    """Makes ``directory`` and everything in it owned by ``uid`` (the program's)."""
    os.chown(directory, uid, uid)
    for root, folders, files in os.walk(directory):
        for name in folders + files:
            os.chown(os.path.join(root, name), uid, uid, follow_symlinks=False)


@dataclass(frozen=True)
class Finished:
    """How a run through `run` ended.

    Args:
      stdout, stderr: output, at most ``output_bytes`` together.
      exit_code: the program's exit status, or None.
      signal: the signal that killed the program (not the sweep's), or None.
      cpu_seconds: CPU time of the program and the children it waited for.
      seconds: wall time from launch to the last process gone.
      timed_out: stopped at the wall deadline.
      output_limited: stopped for writing more than ``output_bytes``.
    """

    stdout: bytes
    stderr: bytes
    exit_code: int | None
    signal: int | None
    cpu_seconds: float
    seconds: float
    timed_out: bool
    output_limited: bool


class Launched:
    """A program started under the supervisor, with its pipes (see the module docstring).

    Args:
      argv: the command, run without a shell; ``argv[0]`` is looked up on ``env``'s PATH.
      cwd: its working directory.
      limits: RLIMIT_CPU, RLIMIT_AS and RLIMIT_NPROC come from here (the wall deadline and
        output cap are the caller's: `run` applies them).
      env: its whole environment; default `minimal_environment(cwd)`.
      uid: run as this uid and gid (root only; see `lease_uid`), or None for the caller's.
      owns_cwd: ``cwd`` is this program's alone: should the launching process die first (a
        SIGKILLed trainer), the supervisor removes it after its sweep. Otherwise removing it
        is the caller's business.

    Attributes:
      stdin, stdout, stderr: binary pipes to the program.
      pid: the supervisor's pid.

    Raises:
      SandboxError: the supervisor could not be started.
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        cwd: str,
        limits: SandboxLimits,
        env: Mapping[str, str] | None = None,
        uid: int | None = None,
        owns_cwd: bool = False,
    ) -> None:
        status_r, status_w = os.pipe()
        config = {
            "argv": list(argv),
            "cwd": str(cwd),
            "env": dict(minimal_environment(str(cwd)) if env is None else env),
            "cpu": list(limits.cpu_rlimit),
            "memory": limits.memory_bytes,
            "processes": limits.processes,
            "uid": uid,
            "gid": uid,
            "parent": os.getpid(),
            "status_fd": status_w,
            "owns_cwd": bool(owns_cwd),
        }
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-I", "-S", _SUPERVISOR, marshal.dumps(config).hex()],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env={},
                start_new_session=True,
                pass_fds=(status_w,),
            )
        except OSError as exc:
            os.close(status_r)
            raise SandboxError(f"cannot start the sandbox supervisor: {exc}") from exc
        finally:
            os.close(status_w)
        os.set_blocking(status_r, False)  # read as it comes (`run`), drained in `wait`
        self._status_fd = status_r
        self._status = b""
        self._report: dict | None = None
        self._line = b""  # stdout read by `receive_line` past its last line
        self.pid = self._process.pid
        self.stdin = self._process.stdin
        self.stdout = self._process.stdout
        self.stderr = self._process.stderr

    @property
    def status_fd(self) -> int:
        """Readable; end-of-file once the supervisor has swept and is about to exit."""
        return self._status_fd

    def read_status(self) -> bool:
        """Reads what the status descriptor has; True at its end-of-file."""
        try:
            chunk = os.read(self._status_fd, 4096)
        except BlockingIOError:
            return False
        self._status += chunk
        return not chunk

    def stop(self) -> None:
        """Kills the whole tree (idempotent); returns once the supervisor has swept it."""
        if self._process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self._process.send_signal(signal.SIGTERM)
        self.wait()

    def wait(self, timeout: float | None = None) -> dict:
        """Waits for the supervisor's exit; returns its report.

        The report has ``exit``, ``signal``, ``cpu``, ``stopped`` and ``error``.

        Raises:
          subprocess.TimeoutExpired: not ended within ``timeout`` seconds.
          SandboxError: the program could not be set up, or the supervisor died without
            reporting (it was then killed with its process group).
        """
        if self._report is None:
            self._process.wait(timeout)
            os.set_blocking(self._status_fd, True)
            while not self.read_status():
                pass
            os.close(self._status_fd)
            for pipe in (self.stdin, self.stdout, self.stderr):
                with contextlib.suppress(OSError):
                    pipe.close()
            try:
                self._report = ast.literal_eval(self._status.decode().splitlines()[-1])
            except (ValueError, IndexError, SyntaxError):
                self._report = {"error": f"the supervisor exited {self._process.returncode}"}
        if self._report.get("error"):
            raise SandboxError(f"sandbox could not run the program: {self._report['error']}")
        return self._report

    def _kill(self) -> None:
        """Last resort (the supervisor did not sweep in time): SIGKILL it and the program's
        process group; the program's own parent-death signal is SIGKILL too."""
        with contextlib.suppress(OSError):
            self.read_status()
        groups = [self.pid]
        if self._status.startswith(b"started "):
            groups.append(int(self._status.split(b"\n", 1)[0].split()[1]))
        for group in groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, signal.SIGKILL)
        self._process.wait()

    def send(self, data: bytes, *, timeout: float) -> None:
        """Writes all of ``data`` to the program's stdin within ``timeout`` seconds.

        Raises:
          TimeoutError: the program stopped reading (its pipe stayed full).
          BrokenPipeError: the program closed its stdin or ended.
        """
        fd = self.stdin.fileno()
        os.set_blocking(fd, False)
        deadline = time.monotonic() + timeout
        view = memoryview(data)
        while view:
            left = deadline - time.monotonic()
            if left <= 0 or not _ready(fd, selectors.EVENT_WRITE, left):
                raise TimeoutError(f"the program read none of the last input for {timeout} s")
            with contextlib.suppress(BlockingIOError):
                view = view[os.write(fd, view[: 1 << 16]) :]

    def receive_line(self, *, timeout: float, limit: int) -> bytes:
        """The program's next stdout line (with its ``\\n``), within ``timeout`` seconds.

        Reads stdout itself (do not also read `stdout`); stderr is left alone, so a worker
        that fills its stderr pipe blocks: point it at a file or drain it.

        Raises:
          TimeoutError: no whole line came within ``timeout`` seconds.
          ValueError: the line is longer than ``limit`` bytes.
          EOFError: stdout ended first (the program exited or closed it).
        """
        fd = self.stdout.fileno()
        os.set_blocking(fd, False)
        deadline = time.monotonic() + timeout
        while (end := self._line.find(b"\n")) < 0:
            if len(self._line) > limit:
                raise ValueError(f"the program's line is longer than {limit} bytes")
            left = deadline - time.monotonic()
            if left <= 0 or not _ready(fd, selectors.EVENT_READ, left):
                raise TimeoutError(f"the program wrote no whole line within {timeout} s")
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                continue
            if not chunk:
                raise EOFError("the program's stdout ended")
            self._line += chunk
        if end + 1 > limit:
            raise ValueError(f"the program's line is longer than {limit} bytes")
        line, self._line = self._line[: end + 1], self._line[end + 1 :]
        return line

    def __enter__(self) -> Launched:
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(SandboxError):
            self.stop()


def run(
    argv: Sequence[str],
    *,
    cwd: str,
    limits: SandboxLimits,
    stdin: bytes = b"",
    env: Mapping[str, str] | None = None,
    uid: int | None = None,
    on_stop: Callable[[], None] | None = None,
) -> Finished:
    """Runs ``argv`` to completion under ``limits`` (wall deadline and output cap included).

    Args:
      argv, cwd, env, uid: as for `Launched`.
      limits: all of it: the rlimits, ``wall_seconds`` and ``output_bytes``.
      stdin: written to the program, then closed (a program that does not read it is fine).
      on_stop: called before the tree is stopped for the deadline or the output cap (a
        container runner kills its container by name there).

    Returns:
      `Finished`, once no process of the program is left.

    Raises:
      SandboxError: the sandbox could not run the program.
    """
    start = time.monotonic()
    deadline = start + limits.wall_seconds
    launched = Launched(argv, cwd=cwd, limits=limits, env=env, uid=uid)
    chunks: dict[int, list[bytes]] = {launched.stdout.fileno(): [], launched.stderr.fileno(): []}
    total = 0
    timed_out = limited = stopped = False
    give_up = float("inf")  # once stopped: when the supervisor is killed for not sweeping
    selector = selectors.DefaultSelector()
    try:
        for fd in (*chunks, launched.status_fd):
            os.set_blocking(fd, False)
            selector.register(fd, selectors.EVENT_READ)
        pending = memoryview(stdin)
        stdin_fd = launched.stdin.fileno()
        if pending:
            os.set_blocking(stdin_fd, False)
            selector.register(stdin_fd, selectors.EVENT_WRITE)
        else:
            launched.stdin.close()
        while selector.get_map():
            now = time.monotonic()
            if now >= deadline and not stopped:
                timed_out = stopped = True
                give_up = _stop(launched, on_stop)
            elif now >= give_up:
                launched._kill()
                break
            for key, _ in selector.select(min(deadline, give_up) - now if not stopped else 0.1):
                fd = key.fd
                if fd == stdin_fd:
                    try:
                        pending = pending[os.write(fd, pending[: 1 << 16]) :]
                    except (BrokenPipeError, BlockingIOError) as exc:
                        if isinstance(exc, BlockingIOError):
                            continue
                        pending = pending[:0]
                    if not pending:
                        selector.unregister(fd)
                        launched.stdin.close()
                elif fd == launched.status_fd:
                    if launched.read_status():
                        selector.unregister(fd)
                else:
                    try:
                        chunk = os.read(fd, 1 << 16)
                    except BlockingIOError:
                        continue
                    if not chunk:
                        selector.unregister(fd)
                        continue
                    keep = chunk[: max(0, limits.output_bytes - total)]
                    chunks[fd].append(keep)
                    total += len(chunk)
                    if total > limits.output_bytes and not stopped:
                        limited = stopped = True
                        give_up = _stop(launched, on_stop)
    except BaseException:  # an interrupt or a bug here: still leave nothing running
        launched._kill()
        raise
    finally:
        selector.close()
    report = launched.wait()
    out, err = (b"".join(chunks[fd]) for fd in chunks)
    return Finished(
        stdout=out,
        stderr=err,
        exit_code=report["exit"],
        signal=report["signal"],
        cpu_seconds=float(report["cpu"]),
        seconds=time.monotonic() - start,
        timed_out=timed_out,
        output_limited=limited,
    )


def _ready(fd: int, event: int, timeout: float) -> bool:
    """Whether ``fd`` becomes ready for ``event`` within ``timeout`` seconds."""
    with selectors.DefaultSelector() as selector:
        selector.register(fd, event)
        return bool(selector.select(timeout))


def _stop(launched: Launched, on_stop: Callable[[], None] | None) -> float:
    """Asks the supervisor to sweep; returns when to give up waiting for it."""
    if on_stop is not None:
        on_stop()
    with contextlib.suppress(ProcessLookupError):
        os.kill(launched.pid, signal.SIGTERM)
    return time.monotonic() + _STOP_GRACE
