"""`SubprocessEnvironment`: tool episodes served by a worker process over JSON lines.

``SubprocessEnvironment(command, limits)`` is an environment factory for
:class:`~dew_pipe.objectives.rl.EpisodeRollout`: called with an
:class:`~dew_pipe.objectives.rl.EpisodeId` it returns a :class:`SubprocessSession`, a
context manager whose ``__enter__`` starts ``command`` (an argv, no shell) in a fresh
temporary directory, in its own session and process group, through the sandbox launcher
(:class:`dew_pipe.sandbox.launch.Launched`, the one ``ProcessRunner`` uses too). The
launcher sets RLIMIT_CPU and RLIMIT_AS from ``limits``, gives the worker a minimal
environment and SIGKILL when its supervisor dies, and its supervisor kills the whole tree
when the trainer process dies. The session adds what only the parent can enforce: a
wall-clock deadline for the whole session (``limits.wall_seconds`` from ``__enter__``,
including the time the episode waits for the model between steps) and a cap on each reply
line (``limits.output_bytes``). ``__exit__`` kills the process group and removes the
directory.

The protocol: one JSON object per line, UTF-8, each request answered by exactly one line.

========================================================  ==================================
request (trainer -> worker)                               reply (worker -> trainer)
========================================================  ==================================
``{"type": "reset", "episode": {"task": 3, "step": 0,``   an observation: ``{"context":
``"sample": 1, "seed": 42}}``                             [2, 5], "status": "running",
                                                          "detail": ""}``
``{"type": "step", "context": [2, 5], "tokens": [3, 1],`` an observation (``context`` may be
``"stopped": true, "policy_step": 0}``                    null or absent once terminal)
``{"type": "get_state"}``                                 ``{"state": "<base64>"}``
``{"type": "set_state", "state": "<base64>"}``            ``{"restored": true}``
========================================================  ==================================

``status`` is one of running, completed, truncated, cancelled, error (default running);
``detail`` is free text (default ""). Any request may instead be answered with
``{"error": "message"}``, which fails the episode with that message. An observation with
another key, or a line that is not such an object, is a protocol error. A worker ends when
its stdin closes (it is killed at the session's exit either way), writes its diagnostics to
stderr (the last lines are quoted when it fails) and must flush stdout after every reply.

A worker that hangs past the deadline, exceeds its memory or CPU limit, crashes, writes a
line that is not JSON or longer than the cap, or breaks the protocol raises
:class:`WorkerError` naming the episode, the request and what happened; the worker is killed
at once, so the episode (and with it the rollout's collection) fails instead of hanging the
trainer. The worker keeps the caller's uid, filesystem and network: run untrusted code
inside an outer sandbox.

Example:
    >>> import os, sys, tempfile
    >>> worker = tempfile.NamedTemporaryFile("w", suffix=".py", delete=False)
    >>> _ = worker.write('''
    ... import json, sys
    ... for line in sys.stdin:
    ...     request = json.loads(line)
    ...     if request["type"] == "reset":
    ...         reply = {"context": [2, 5 + request["episode"]["task"]]}
    ...     else:
    ...         reply = {"status": "completed", "detail": str(request["tokens"])}
    ...     print(json.dumps(reply), flush=True)
    ... ''')
    >>> worker.close()
    >>> factory = SubprocessEnvironment([sys.executable, worker.name], SandboxLimits())
    >>> with factory(EpisodeId(task=1, step=0, sample=0, seed=7)) as env:
    ...     first = env.reset()
    ...     action = Action(first.context, [3, 1], [-0.1, -0.2], [-0.1, -0.2],
    ...                     stopped=True, policy_step=0)
    ...     last = env.step(action)
    >>> first.context.tolist(), last.status.value, last.detail
    ([2, 6], 'completed', '[3, 1]')
    >>> os.unlink(worker.name)
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from dew_pipe.objectives.rl.episodes import Action, EpisodeId, Observation
from dew_pipe.sandbox.launch import Launched, minimal_environment
from dew_pipe.sandbox.program import SandboxError, SandboxLimits

__all__ = ["SubprocessEnvironment", "SubprocessSession", "WorkerError"]

_OBSERVATION_KEYS = frozenset({"context", "status", "detail"})
_STDERR_TAIL = 2048  # bytes of the worker's stderr kept for the failure message
_EXIT_WAIT_S = 5.0  # how long a worker whose stdout ended gets to be reaped by its supervisor
_QUOTE = 120  # characters of an offending line quoted in a message


class WorkerError(RuntimeError):
    """A subprocess worker failed its episode: hung, crashed, hit a limit or broke the protocol."""


class SubprocessEnvironment:
    """An environment factory whose episodes run in a worker process (module docstring).

    Args:
        command: the worker's argv (no shell); ``command[0]`` is looked up on the minimal
            PATH (``/usr/local/bin:/usr/bin:/bin``) unless it contains a slash.
        limits: RLIMIT_CPU (``cpu_seconds``) and RLIMIT_AS (``memory_bytes``) for the worker,
            its process count, the session's wall-clock deadline (``wall_seconds``) and the
            longest reply line (``output_bytes``); None for ``SandboxLimits()``.
        env: variables added to the worker's minimal environment (PATH, LANG, HOME and TMPDIR
            at its directory); nothing of the trainer's own environment is passed.

    Raises:
        TypeError / ValueError: an empty command or one that is not a sequence of str, limits
            that are not SandboxLimits, an env that is not a str -> str mapping.

    Example:
        >>> SubprocessEnvironment(["python3", "worker.py"]).command
        ('python3', 'worker.py')
    """

    def __init__(
        self,
        command: Sequence[str],
        limits: SandboxLimits | None = None,
        *,
        env: Mapping[str, str] | None = None,
    ) -> None:
        if isinstance(command, str | bytes) or not isinstance(command, Sequence):
            raise TypeError(f"command is {command!r}; expected a sequence of str (an argv)")
        command = tuple(command)
        if not command:
            raise ValueError("command is empty; expected at least the program to run")
        for arg in command:
            if not isinstance(arg, str) or "\0" in arg:
                raise TypeError(f"command holds {arg!r}; expected str arguments without NUL")
        limits = SandboxLimits() if limits is None else limits
        if not isinstance(limits, SandboxLimits):
            raise TypeError(f"limits is {limits!r}; expected dew_pipe.sandbox.SandboxLimits")
        extra = dict(env or {})
        for name, value in extra.items():
            if not (isinstance(name, str) and isinstance(value, str)) or "\0" in name + value:
                raise TypeError(f"env holds {name!r}: {value!r}; expected str -> str")
        self.command = command
        self.limits = limits
        self.env = extra

    def __call__(self, episode: EpisodeId) -> SubprocessSession:
        """The session of one episode (nothing starts before ``__enter__``)."""
        if not isinstance(episode, EpisodeId):
            raise TypeError(f"episode is {type(episode).__name__}; expected an EpisodeId")
        return SubprocessSession(self, episode)

    def __repr__(self) -> str:
        return f"SubprocessEnvironment({list(self.command)!r}, {self.limits!r})"


class SubprocessSession:
    """One episode's worker: ``reset``, ``step``, ``get_state``, ``set_state`` as requests.

    Made by :class:`SubprocessEnvironment`; a context manager (``__enter__`` starts the
    worker, ``__exit__`` kills its process group and removes its directory). Every method
    raises :class:`WorkerError` when the worker fails (module docstring); after one failure
    the worker is gone and every later request raises too.

    Attributes:
        episode: the :class:`EpisodeId` it serves.
        directory: the worker's temporary working directory (None outside the context).
    """

    def __init__(self, factory: SubprocessEnvironment, episode: EpisodeId) -> None:
        self.factory = factory
        self.episode = episode
        self.directory: str | None = None
        self._launched: Launched | None = None
        self._deadline = 0.0
        self._failed: str | None = None
        self._closed = False
        self._stderr = bytearray()
        self._drain: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> SubprocessSession:
        if self._launched is not None or self.directory is not None:
            raise RuntimeError(f"{self._who()} was already entered; a session runs once")
        limits = self.factory.limits
        self.directory = tempfile.mkdtemp(prefix="dew-episode-")
        env = {**minimal_environment(self.directory), **self.factory.env}
        try:
            self._launched = Launched(
                self.factory.command, cwd=self.directory, limits=limits, env=env, owns_cwd=True
            )
        except BaseException:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None
            raise
        self._deadline = time.monotonic() + limits.wall_seconds
        self._drain = threading.Thread(
            target=self._read_stderr, name=f"dew-episode-stderr-{self._launched.pid}", daemon=True
        )
        self._drain.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._closed = True
        try:
            self._stop()
        finally:
            if self.directory is not None:
                shutil.rmtree(self.directory, ignore_errors=True)

    def _stop(self) -> None:
        """Kills the worker's tree (idempotent) and collects the rest of its stderr."""
        if self._launched is not None:
            with contextlib.suppress(SandboxError):
                self._launched.stop()
        if self._drain is not None:
            self._drain.join(timeout=_EXIT_WAIT_S)

    def _read_stderr(self) -> None:
        stream = self._launched.stderr
        with contextlib.suppress(OSError, ValueError):
            while chunk := stream.read1(1 << 14):
                self._stderr += chunk
                del self._stderr[:-_STDERR_TAIL]

    # ------------------------------------------------------------------ the protocol

    def reset(self) -> Observation:
        """The first observation; the request carries the episode identity."""
        identity = {
            name: getattr(self.episode, name) for name in ("task", "step", "sample", "seed")
        }
        return self._observation(self._ask({"type": "reset", "episode": identity}), "reset")

    def step(self, action: Action) -> Observation:
        """The worker's observation after ``action`` (its context, tokens, flag and step)."""
        if not isinstance(action, Action):
            raise TypeError(f"action is {type(action).__name__}; expected an Action")
        request = {
            "type": "step",
            "context": action.context.tolist(),
            "tokens": action.tokens.tolist(),
            "stopped": action.stopped,
            "policy_step": action.policy_step,
        }
        return self._observation(self._ask(request), "step")

    def get_state(self) -> bytes:
        """The worker's snapshot: the bytes of its base64 ``state`` reply."""
        reply = self._ask({"type": "get_state"})
        state = reply.get("state")
        if set(reply) != {"state"} or not isinstance(state, str):
            self._fail(f'replied {_quote(reply)} to get_state; expected {{"state": "<base64>"}}')
        try:
            return base64.b64decode(state.encode("ascii"), validate=True)
        except (binascii.Error, UnicodeEncodeError) as error:
            self._fail(f"replied to get_state with a state that is not base64 ({error})")

    def set_state(self, state: bytes) -> None:
        """Restores a snapshot from :meth:`get_state`; the worker must acknowledge it."""
        if not isinstance(state, bytes | bytearray | memoryview):
            raise TypeError(f"state is {type(state).__name__}; expected bytes from get_state()")
        encoded = base64.b64encode(bytes(state)).decode("ascii")
        reply = self._ask({"type": "set_state", "state": encoded})
        if reply != {"restored": True}:
            self._fail(f'replied {_quote(reply)} to set_state; expected {{"restored": true}}')

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        """Sends one request and returns its reply object, or raises WorkerError."""
        what = request["type"]
        if self._launched is None or self._closed:
            raise RuntimeError(f"{self._who()}: {what} outside the session's context")
        if self._failed is not None:
            raise WorkerError(f"{self._who()}: {what} after the worker failed: {self._failed}")
        limits = self.factory.limits
        try:
            self._launched.send(json.dumps(request).encode() + b"\n", timeout=self._left(what))
            line = self._launched.receive_line(timeout=self._left(what), limit=limits.output_bytes)
        except TimeoutError:
            self._fail(
                f"gave no reply to {what} within the session's wall-clock deadline "
                f"(SandboxLimits.wall_seconds={limits.wall_seconds:g})"
            )
        except ValueError:
            self._fail(
                f"replied to {what} with a line longer than "
                f"SandboxLimits.output_bytes={limits.output_bytes} bytes"
            )
        except (EOFError, BrokenPipeError):
            self._fail(f"ended before replying to {what}: {self._ending()}")
        try:
            reply = json.loads(line)
        except ValueError:
            self._fail(f"replied to {what} with a line that is not JSON: {_quote(line)}")
        if not isinstance(reply, dict):
            self._fail(f"replied to {what} with {_quote(reply)}; expected a JSON object")
        if "error" in reply:
            self._fail(f"reported an error on {what}: {reply['error']}")
        return reply

    def _observation(self, reply: dict[str, Any], what: str) -> Observation:
        unknown = sorted(set(reply) - _OBSERVATION_KEYS)
        if unknown:
            self._fail(
                f"replied to {what} with unknown field(s) {unknown} in {_quote(reply)}; "
                "expected context, status and detail"
            )
        try:
            return Observation(
                reply.get("context"), reply.get("status", "running"), reply.get("detail", "")
            )
        except (TypeError, ValueError) as error:
            self._fail(f"replied to {what} with a bad observation {_quote(reply)}: {error}")

    # ------------------------------------------------------------------ failures

    def _left(self, what: str) -> float:
        left = self._deadline - time.monotonic()
        if left <= 0:
            self._fail(
                f"ran past the session's wall-clock deadline before {what} "
                f"(SandboxLimits.wall_seconds={self.factory.limits.wall_seconds:g})"
            )
        return left

    def _fail(self, what: str) -> NoReturn:
        """Kills the worker and raises WorkerError naming the episode and ``what``."""
        self._failed = what
        self._stop()
        raise WorkerError(f"{self._who()} {what}")

    def _ending(self) -> str:
        """How the worker ended: its exit status or signal, the limit it hit, its stderr."""
        launched, limits = self._launched, self.factory.limits
        # stderr first: it ends once the worker's tree is gone, and `wait` closes the pipe.
        self._drain.join(timeout=_EXIT_WAIT_S)
        try:
            if self._drain.is_alive():  # stderr still open: the worker runs on
                raise subprocess.TimeoutExpired(self.factory.command, _EXIT_WAIT_S)
            report = launched.wait(timeout=_EXIT_WAIT_S)
        except subprocess.TimeoutExpired:  # it closed stdout but runs on
            self._stop()
            return "it closed its stdout and did not exit"
        except SandboxError as error:
            return str(error)
        number = report.get("signal")
        if number == signal.SIGXCPU or (
            number == signal.SIGKILL and report.get("cpu", 0.0) >= limits.cpu_rlimit[0]
        ):
            how = f"it exceeded its CPU time (SandboxLimits.cpu_seconds={limits.cpu_seconds:g})"
        elif number is not None:
            how = f"it was killed by signal {signal.Signals(number).name}"
        else:
            how = f"it exited with status {report.get('exit')}"
        tail = bytes(self._stderr).decode(errors="replace").strip()
        if tail:
            last = " | ".join(tail.splitlines()[-3:])
            how += f"; its stderr ends: {last[-400:]}"
        if "MemoryError" in tail:
            how += f" (it ran out of its SandboxLimits.memory_bytes={limits.memory_bytes})"
        return how

    def _who(self) -> str:
        i = self.episode
        return (
            f"worker {list(self.factory.command)!r} of episode (task {i.task}, step {i.step}, "
            f"sample {i.sample}, seed {i.seed})"
        )


def _quote(value: Any) -> str:
    """A short quotation of an offending line or reply for a message."""
    text = value.decode(errors="replace") if isinstance(value, bytes) else json.dumps(value)
    text = text.rstrip("\n")
    return repr(text if len(text) <= _QUOTE else text[:_QUOTE] + "...")
