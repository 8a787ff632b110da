"""`EnvironmentSource`: multi-turn tool episodes as sessions, each turn drawn from a server.

Each submitted sample is one episode of the in-process Environment protocol
(:mod:`dew_pipe.objectives.rl.episodes`), run on a worker thread of its own:

1. ``environment(task, identity)`` makes the session's environment, which is entered;
   ``identity`` is an ``EpisodeId(task.id, step=<version served at submission>, sample,
   seed)`` whose seed is fixed by the submission (seed, task, group, sample, attempt).
2. ``reset()`` gives the first context; each turn submits the latest context to the
   `RolloutServer` with a budget of ``max_new_tokens``. Turns of different sessions are
   separate requests, so they share the server's continuous batch as they come (a session
   that ends early frees its row at once) instead of waiting for a lock-step cohort.
3. The draw becomes an ``Action`` (ids, raw and behavior log-probabilities exactly as the
   server returned them) and goes to ``step(action)``, which gives the exact next context
   or a terminal result.
4. ``verifier(task, episode)`` scores the finished episode while its environment is still
   open; the environment is then released.

The session's calls are the draws themselves (``Draw.call()``: each call stamped with its
own draw's version, so turns after a weight push carry the newer version and the session's
staleness is its oldest call's). Nothing is retokenized. Statuses:

- COMPLETED: the environment ended the episode; scored.
- TRUNCATED: a limit ended it: a response that used its whole budget without EOS (never
  sent to the environment), a context longer than ``max_prompt_tokens`` (recorded whole,
  not submitted), or ``max_turns`` model calls with the environment still running. Scored
  all the same (``pack``'s default ``truncation="mask"`` drops it from training).
- INFRA_ERROR: the factory, ``__enter__``, ``reset`` or ``step`` raised or returned
  something that is not an Observation, the environment reported ERROR, a draw failed, the
  verifier raised or returned something that is not a finite number, or releasing the
  environment failed (the episode is thrown out unscored); ``detail`` says which.
- CANCELLED: `EnvironmentSource.cancel` stopped it, or the environment reported CANCELLED.

A task's payload is whatever ``environment`` and ``verifier`` read (``task.data``; a
``task_ids`` task carries only its id). A server that refuses a request outright (it is
closed or failed) breaks the source: that session's future raises, after its environment
is released.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import math
import numbers
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from dew_pipe._pool import WorkerPool
from dew_pipe._validate import check_int
from dew_pipe.inference.prompt_source import _seed
from dew_pipe.objectives.rl.episode_sessions import STATUSES
from dew_pipe.objectives.rl.episodes import (
    Action,
    Episode,
    EpisodeId,
    EpisodeStatus,
    Observation,
    Transition,
    is_cancellation,
)
from dew_pipe.objectives.rl.sessions import Call, Session, Status, Task

__all__ = ["EnvironmentSource"]

_RUNNING, _TERMINAL = EpisodeStatus.RUNNING, (EpisodeStatus.COMPLETED, EpisodeStatus.TRUNCATED)


class _Failed(Exception):
    """Ends an episode as INFRA_ERROR with ``detail`` (internal)."""


class _Entry:
    """One submitted session: its identity, its future, and what cancel needs to reach."""

    def __init__(self, task: Task, group: int, sample: int, attempt: int, identity: EpisodeId):
        self.task, self.group, self.sample, self.attempt = task, group, sample, attempt
        self.identity = identity
        self.future: cf.Future[Session] = cf.Future()
        self.started = False
        self.cancellation: cf.CancelledError | None = None  # set by cancel()
        self.draw: cf.Future | None = None  # the turn being drawn now

    def session(self, status: Status, calls=(), reward=None, detail: str = "") -> Session:
        return Session(
            self.task.id, self.group, self.sample, self.attempt, calls, status, reward,
            detail=detail,
        )  # fmt: skip


class _Record:
    """What one episode has recorded so far."""

    def __init__(self, identity: EpisodeId) -> None:
        self.identity = identity
        self.first: Observation | None = None
        self.transitions: list[Transition] = []
        self.calls: list[Call] = []
        self.status = _RUNNING
        self.detail = ""

    def end(self, status: EpisodeStatus, detail: str) -> None:
        self.status, self.detail = status, detail

    def episode(self, reward: float | None = None) -> Episode:
        first = self.first
        if first is None:  # reset never returned: the failure stands in for its observation
            first = Observation(status=EpisodeStatus.ERROR, detail=self.detail)
        return Episode(self.identity, first, self.transitions, self.status, self.detail, reward)


class EnvironmentSource:
    """A `SessionSource` of multi-turn tool episodes drawn from a `RolloutServer`.

    See the module docstring for the episode, its statuses and its records.

    Args:
        server: the `RolloutServer` every turn is drawn from (not closed by `close`).
        environment: ``environment(task, identity) -> Environment``, a context manager
            whose ``__enter__`` returns the object ``reset``/``step`` are called on;
            ``identity`` is the session's `EpisodeId`.
        verifier: ``verifier(task, episode) -> float``, a finite reward; it sees the
            status, the detail and every transition, and runs while the environment is open.
        max_prompt_tokens: P, the longest context submitted (>= 1).
        max_new_tokens: R, the budget of every turn (>= 1).
        max_turns: T, the most model calls per episode (>= 1).
        workers: episodes running at once, one thread each (most of their time is spent
            waiting for a draw, so size it to the server's ``slots`` or above).
        seed: mixed into every episode's seed and every turn's draw seed, which are
            otherwise fixed by the submission's task, group, sample, attempt and turn.
        record: ``record(task, episode)``, called on the worker thread with every episode
            as it ends (failed and cancelled ones too, reward None); if it raises, the
            session's future raises (a broken source).

    Raises:
        TypeError / ValueError: a server without ``submit``, an environment, verifier or
            record that is not callable, a bad count; ``P + R - 1`` beyond a native
            server's ``capacity``.

    Example:
        >>> source = EnvironmentSource(server, environment, verifier, max_prompt_tokens=32,
        ...                            max_new_tokens=8, max_turns=3, workers=16)  # doctest: +SKIP
        >>> session = source.submit(Task(5), group=0, sample=0, attempt=0).result()  # doctest: +SKIP
        >>> session.status, len(session.calls), [c.version for c in session.calls]  # doctest: +SKIP
        (<Status.COMPLETED: 'completed'>, 2, [0, 0])
    """

    def __init__(
        self,
        server: Any,
        environment: Callable[[Task, EpisodeId], Any],
        verifier: Callable[[Task, Episode], float],
        *,
        max_prompt_tokens: int,
        max_new_tokens: int,
        max_turns: int,
        workers: int = 8,
        seed: int = 0,
        record: Callable[[Task, Episode], Any] | None = None,
    ) -> None:
        if not callable(getattr(server, "submit", None)):
            raise TypeError(f"server is {type(server).__name__}; expected a RolloutServer")
        for name, value in (("environment", environment), ("verifier", verifier)):
            if not callable(value):
                raise TypeError(f"{name} is {value!r}; expected a callable")
        if record is not None and not callable(record):
            raise TypeError(f"record is {record!r}; expected None or record(task, episode)")
        self.server, self.environment, self.verifier = server, environment, verifier
        self.record = record
        self.max_prompt_tokens = check_int("max_prompt_tokens", max_prompt_tokens, minimum=1)
        self.max_new_tokens = check_int("max_new_tokens", max_new_tokens, minimum=1)
        self.max_turns = check_int("max_turns", max_turns, minimum=1)
        self.workers = check_int("workers", workers, minimum=1)
        self.seed = check_int("seed", seed)
        engine = getattr(server, "server", None)  # a NativeRolloutServer's Server
        capacity = getattr(engine, "capacity", None)
        need = self.max_prompt_tokens + self.max_new_tokens - 1
        if isinstance(capacity, int) and need > capacity:
            raise ValueError(
                f"max_prompt_tokens ({self.max_prompt_tokens}) + max_new_tokens "
                f"({self.max_new_tokens}) - 1 = {need} exceeds the server's capacity={capacity}"
            )
        sampling = getattr(engine, "sampling", None)
        self._eos = tuple(getattr(sampling, "eos_ids", ()) or ())  # checked when known
        self._pool = WorkerPool(self.workers, name="episode")  # daemons: see _pool
        self._lock = threading.Lock()
        self._pending: dict[cf.Future, _Entry] = {}
        self._closed = False

    def submit(self, task: Task, *, group: int, sample: int, attempt: int) -> cf.Future[Session]:
        """Starts one episode of ``task`` on a worker thread; returns its future session.

        Raises:
            TypeError / ValueError: a task that is not a `Task`, bad identity fields.
            RuntimeError: the source is closed.
        """
        if not isinstance(task, Task):
            raise TypeError(f"task is {type(task).__name__}; expected a sessions.Task")
        group = check_int("group", group)
        sample = check_int("sample", sample, minimum=0)
        attempt = check_int("attempt", attempt, minimum=0)
        version = int(getattr(self.server, "version", 0))
        seed = _seed(self.seed, task.id, group, sample, attempt)
        entry = _Entry(task, group, sample, attempt, EpisodeId(task.id, version, sample, seed))
        with self._lock:
            if self._closed:
                raise RuntimeError("the EnvironmentSource is closed")
            self._pending[entry.future] = entry
            self._pool.submit(self._run, entry)
        return entry.future

    def cancel(self, future: cf.Future[Session]) -> None:
        """Stops the episode behind ``future`` at its next turn; it resolves CANCELLED.

        A draw in flight is cancelled on the server at once (it leaves the queue or its
        row); a ``step`` running now finishes first and its result is not used. The
        environment exits under the cancellation (a ``concurrent.futures.CancelledError``)
        and the future resolves once it is released; an episode that had not started
        resolves at once. Unknown or finished futures are left alone.
        """
        with self._lock:
            entry = self._pending.get(future)
            if entry is None or entry.cancellation is not None:
                return
            entry.cancellation = cf.CancelledError("cancelled by the caller")
            draw, started = entry.draw, entry.started
            if not started:
                self._pending.pop(future, None)
        if draw is not None:
            draw.cancel()
        if not started:
            self._set(entry, entry.session(Status.CANCELLED, detail="cancelled by the caller"))

    def close(self) -> None:
        """Cancels every unfinished episode and waits until their environments are released.

        The server stays up (it may be shared). An environment stuck inside ``step`` holds
        this up: environments must bound their own step time.
        """
        with self._lock:
            self._closed = True
            futures = list(self._pending)
        for future in futures:
            self.cancel(future)
        self._pool.shutdown(wait=True)

    def __enter__(self) -> EnvironmentSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ the worker

    def _run(self, entry: _Entry) -> None:
        with self._lock:
            if entry.cancellation is not None:  # cancelled before it started: resolved
                return
            entry.started = True
        record = _Record(entry.identity)
        try:
            reward = self._episode(entry, record)
            if self.record is not None:
                self.record(entry.task, record.episode(reward))
        except BaseException as error:  # a broken source (or a bug): say so to the caller
            with self._lock:
                self._pending.pop(entry.future, None)
            with contextlib.suppress(cf.InvalidStateError):
                entry.future.set_exception(error)
            return
        with self._lock:
            self._pending.pop(entry.future, None)
        status = STATUSES[record.status]
        self._set(entry, entry.session(status, record.calls, reward, record.detail))

    def _episode(self, entry: _Entry, record: _Record) -> float | None:
        """Runs the episode into ``record``; returns its reward (None when unscored)."""
        try:
            manager = self.environment(entry.task, entry.identity)
            env = manager.__enter__()
        except Exception as error:  # noqa: BLE001 - no environment to release
            record.end(EpisodeStatus.ERROR, f"opening the environment failed: {_text(error)}")
            return None
        reward = failure = None  # failure: what the environment exits under
        fatal: BaseException | None = None  # re-raised once the environment is released
        try:
            self._turns(entry, env, record)
            if record.status in _TERMINAL:
                reward = self._verify(entry, record)
        except _Failed as error:
            record.end(EpisodeStatus.ERROR, str(error))
            failure = error.__cause__
        except _Broken as error:
            record.end(EpisodeStatus.ERROR, f"the server refused a turn: {_text(error.__cause__)}")
            failure = fatal = error.__cause__
        except BaseException as error:
            failure = error
            if is_cancellation(error):
                record.end(EpisodeStatus.CANCELLED, str(error) or "cancelled")
            elif isinstance(error, Exception):  # a bug of ours: the source is broken
                record.end(EpisodeStatus.ERROR, f"the source failed: {_text(error)}")
                fatal = error
            else:  # KeyboardInterrupt, SystemExit
                fatal = error
        try:
            if failure is None:
                manager.__exit__(None, None, None)
            else:
                manager.__exit__(type(failure), failure, failure.__traceback__)
        except Exception as error:  # noqa: BLE001 - the episode is thrown out, not scored
            if record.status is not EpisodeStatus.CANCELLED:
                detail = f"releasing the environment failed: {_text(error)}"
                record.end(EpisodeStatus.ERROR, detail)
            reward = None
        if fatal is not None:
            raise fatal
        return reward

    def _turns(self, entry: _Entry, env: Any, record: _Record) -> None:
        """Resets, then alternates draws and steps until a status or a limit ends it."""
        observation = _environment(env.reset, "reset()")
        if observation.status in _TERMINAL:
            raise _Failed(
                f"reset() returned a {observation.status.value} observation; expected RUNNING "
                "with the first context"
            )
        record.first = observation
        while True:
            if observation.status is EpisodeStatus.ERROR:
                raise _Failed(f"the environment reported ERROR: {observation.detail}")
            if observation.status is EpisodeStatus.CANCELLED:
                return record.end(EpisodeStatus.CANCELLED, observation.detail)
            if observation.status is not _RUNNING:
                return record.end(observation.status, observation.detail)
            if observation.context.size > self.max_prompt_tokens:
                return record.end(
                    EpisodeStatus.TRUNCATED,
                    f"the context has {observation.context.size} ids, more than "
                    f"max_prompt_tokens={self.max_prompt_tokens}",
                )
            if len(record.calls) >= self.max_turns:
                return record.end(
                    EpisodeStatus.TRUNCATED,
                    f"max_turns={self.max_turns} model calls reached while the environment runs",
                )
            action = self._draw(entry, record, observation.context)
            if not action.stopped:
                detail = (
                    f"the response used max_new_tokens={self.max_new_tokens} without EOS; "
                    "not sent to the environment"
                )
                cut = Observation(status=EpisodeStatus.TRUNCATED, detail=detail)
                record.transitions.append(Transition(action, cut))
                return record.end(EpisodeStatus.TRUNCATED, detail)
            self._check_cancelled(entry)
            observation = _environment(env.step, "step()", action)
            record.transitions.append(Transition(action, observation))
            self._check_cancelled(entry)

    def _draw(self, entry: _Entry, record: _Record, context: np.ndarray) -> Action:
        """One turn from the server, as an Action; its call is recorded first."""
        self._check_cancelled(entry)
        turn = len(record.calls)
        try:
            draw = self.server.submit(
                context, self.max_new_tokens, seed=_seed(entry.identity.seed, turn)
            )
        except Exception as error:  # the server refuses work: the source is broken
            raise _Broken() from error
        with self._lock:
            entry.draw = draw
            cancelled = entry.cancellation is not None
        if cancelled:
            draw.cancel()
        try:
            result = draw.result()
        except cf.CancelledError:
            self._check_cancelled(entry)  # ours: raises the caller's cancellation
            raise cf.CancelledError("the draw was cancelled on the server") from None
        except Exception as error:  # noqa: BLE001 - a failed draw is an infrastructure failure
            raise _Failed(f"draw failed: {_text(error)}") from error
        finally:
            with self._lock:
                entry.draw = None
        try:
            call = result.call()
            if self._eos:
                call.check_eos(self._eos)
            if not np.array_equal(call.prompt_ids, context):
                raise ValueError("the draw's prompt_ids are not the context submitted")
            action = Action(
                call.prompt_ids, call.sampled_ids, call.log_probs, call.behavior_log_probs,
                result.stopped, call.version,
            )  # fmt: skip
        except (TypeError, ValueError) as error:  # e.g. non-finite likelihoods from the engine
            raise _Failed(f"draw failed: {_text(error)}") from error
        record.calls.append(call)
        return action

    def _check_cancelled(self, entry: _Entry) -> None:
        """Raises the caller's cancellation once ``cancel`` was called."""
        with self._lock:
            cancellation = entry.cancellation
        if cancellation is not None:
            raise cancellation

    def _verify(self, entry: _Entry, record: _Record) -> float:
        try:
            value = self.verifier(entry.task, record.episode())
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"the verifier returned {value!r}; expected a finite float")
            if not math.isfinite(float(value)):
                raise ValueError(f"the verifier returned {value!r}; expected a finite float")
        except Exception as error:  # noqa: BLE001 - a failed verifier is an infra failure
            raise _Failed(f"the verifier failed: {_text(error)}") from error
        return float(value)

    @staticmethod
    def _set(entry: _Entry, session: Session) -> None:
        with contextlib.suppress(cf.InvalidStateError):  # resolved already, or cancelled
            entry.future.set_result(session)


class _Broken(Exception):
    """The server refused a request: re-raised from the session's future (internal)."""


def _environment(method: Callable[..., Any], what: str, *args: Any) -> Observation:
    """The observation ``method(*args)`` returns; a raise or a non-Observation fails the
    episode (cancellations pass through: they end it CANCELLED)."""
    try:
        value = method(*args)
    except Exception as error:
        if is_cancellation(error):
            raise
        raise _Failed(f"{what} raised {_text(error)}") from error
    if not isinstance(value, Observation):
        raise _Failed(f"{what} returned {type(value).__name__}; expected an Observation")
    return value


def _text(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"
