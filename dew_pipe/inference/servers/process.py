"""`ProcessRolloutServer`: the continuous-batching `Server` in a child process.

The in-process `NativeRolloutServer` shares the trainer's XLA runtime: on CPU every JAX
computation of a process runs on one pool of worker threads, so a rollout and an update
running "at the same time" take turns on the same cores. This server starts a fresh Python
process (``python -m dew_pipe.inference.servers.process_worker``) with its own XLA runtime,
optionally pinned to chosen cores (``cpus``) or given its own accelerator (``env``, for example
``CUDA_VISIBLE_DEVICES``), the way a separate inference device serves a trainer in a real
deployment. It answers the same `RolloutServer` requests:

- ``submit`` checks its arguments here, sends the request and returns a future at once; a
  reader thread resolves it with the `Draw` the child sends back. ``submit_many`` sends a
  whole batch as one message (the child queues it with `Server.submit_many`), and the
  child sends the draws that finish together as one message too.
- ``load`` copies the variables to host memory and sends them ahead of any later
  request, then returns a future the child resolves once its server has applied them
  between two decode steps (`Server.reload`); ``version`` moves at once, and draws
  submitted after the call start on the new weights (the child queues them behind it).
- ``future.cancel()`` stops the draw in the child (its queue entry or row is released).

Costs: each push pickles the whole tree (a few milliseconds for a few MB of float32), and
each draw crosses the socket once when it finishes (batched with the others ready then).
Errors keep their type where they can be pickled (a bad prompt fails the future with
ValueError, as in `Server`). If the child dies, every unfinished future and any call
waiting on it fail with RuntimeError, and so does every later request.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pickle
import socket
import subprocess
import sys
import threading
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, InvalidStateError
from multiprocessing.connection import Connection
from typing import Any

import jax
import numpy as np

from dew_pipe._validate import check_int
from dew_pipe.inference.servers.engine_records import ServerCounters
from dew_pipe.inference.servers.engine_setup import (
    ServeTask,
    batch_requests,
    check_tree,
    from_task_arguments,
    prompt_array,
    request_seed,
    signature,
    variables_of,
)
from dew_pipe.inference.servers.interface import Draw
from dew_pipe.sampling import Sampling

__all__ = ["ProcessRolloutServer"]

_DRAW_KINDS = ("draw", "draw_failed", "cancelled")  # messages that end a draw

# Seconds close() waits for the child to close its server and exit before killing it.
_CLOSE_S = 30.0


class _Reply:
    """A request waiting for the child's answer (a push or a counters snapshot)."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.message: tuple | None = None
        self.error: BaseException | None = None


def _cpu_set(cpus: Iterable[int] | None) -> set[int] | None:
    if cpus is None:
        return None
    try:
        values = sorted(cpus)
    except TypeError as error:
        raise TypeError(
            f"cpus is {cpus!r}; expected None or an iterable of core numbers"
        ) from error
    allowed = os.sched_getaffinity(0) | set(range(os.cpu_count() or 1))
    bad = [c for c in values if isinstance(c, bool) or not isinstance(c, int | np.integer)]
    if bad or not values or any(c not in allowed for c in values):
        raise ValueError(
            f"cpus is {cpus!r}; expected a nonempty set of core numbers among {sorted(allowed)}"
        )
    return {int(c) for c in values}


class ProcessRolloutServer:
    """A `RolloutServer` whose continuous-batching `Server` runs in a child process.

    Args:
        task: what to serve, as `Server.from_task` reads it (a `ServeTask`, a
            `TextGeneration`, a `Pretrained`); it is pickled to the child, so the model's
            class must be importable there (the child gets this process's ``sys.path``).
        slots: rows decoded together (`Server`).
        capacity: cache positions per row (`Server`).
        sampling: the controls; None takes ``task.sampling`` when it has one.
        cpus: cores the child may run on (``os.sched_setaffinity`` before JAX starts, so
            XLA's thread pool has one thread per core); None leaves the affinity inherited.
        env: variables set in the child's environment on top of this process's
            (``XLA_FLAGS``, ``JAX_PLATFORMS``, ``CUDA_VISIBLE_DEVICES``...).
        start_timeout: seconds to wait for the child to import JAX and build its server.
        python: the interpreter to run the child with (default ``sys.executable``).
        **options: the other keyword arguments of `Server` (``dtype``, ``queue``,
            ``steps_per_call``, ``record_support``, ``buckets``, ``version``, ``seed``,
            ``pad_id``, ``gather_s``, ``join_rows``, ``warm_up``: a warmed-up child
            compiles before its start is reported, so ``start_timeout`` must cover
            that); ``device`` is refused (choose the child's devices with ``env``).

    Attributes:
        pid: the child's process id.
        info: what the child reported at start: ``pid``, ``cpus`` (its affinity),
            ``devices``.

    Raises:
        TypeError / ValueError: bad arguments, or the options the child's `Server` refused
            (the same errors `Server` raises).
        RuntimeError: the child failed to start within ``start_timeout`` or exited.

    Example:
        >>> task = ServeTask(model, variables, Sampling(eos_id=2))  # doctest: +SKIP
        >>> server = ProcessRolloutServer(task, slots=8, capacity=64, cpus={1})  # doctest: +SKIP
        >>> draw = server.submit([5, 9, 3], 16, seed=0).result()  # doctest: +SKIP
        >>> server.load(state.params, 1).result(); server.version  # doctest: +SKIP
        1
        >>> server.close()  # doctest: +SKIP
    """

    def __init__(
        self,
        task: Any,
        *,
        slots: int,
        capacity: int,
        sampling: Sampling | None = None,
        cpus: Iterable[int] | None = None,
        env: Mapping[str, str] | None = None,
        start_timeout: float = 300.0,
        python: str | None = None,
        **options: Any,
    ) -> None:
        if "device" in options:
            raise TypeError(
                "device is not an option of ProcessRolloutServer; the child picks its own "
                "devices (pass env={'CUDA_VISIBLE_DEVICES': ...} or cpus=...)"
            )
        model, variables, sampling, options = from_task_arguments(task, sampling, options)
        variables = jax.device_get(variables_of(variables, "task.variables"))
        self._signature = signature(variables)
        self._queue = check_int("queue", options.get("queue", 1024), minimum=1)
        self._slots = check_int("slots", slots, minimum=1)
        cpu_set = _cpu_set(cpus)
        if env is not None and not (
            isinstance(env, Mapping)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
        ):
            raise TypeError(f"env is {env!r}; expected a mapping of strings to strings")
        if (
            isinstance(start_timeout, bool)
            or not isinstance(start_timeout, int | float)
            or not start_timeout > 0
        ):
            raise ValueError(f"start_timeout is {start_timeout!r}; expected seconds > 0")
        payload = pickle.dumps(ServeTask(model, variables, sampling))
        setup = {
            "cpus": cpu_set,
            "task": payload,
            "options": {"slots": slots, "capacity": capacity, **options},
        }
        self._cond = threading.Condition()
        self._send_lock = threading.Lock()
        self._pending: dict[int, Future[Draw]] = {}
        self._replies: dict[int, _Reply] = {}
        self._pushes: dict[int, tuple[Future[int], int]] = {}  # token -> (future, version)
        self._ids = itertools.count()
        self._closing = False
        self._error: BaseException | None = None
        self._process, self._connection = self._spawn(env, python)
        try:
            ready = self._handshake(setup, float(start_timeout))
        except BaseException:
            self._kill()
            raise
        self._version: int = ready[1]
        self.info: dict[str, Any] = ready[2]
        self.pid: int = self._process.pid
        self._reader = threading.Thread(
            target=self._read, name="dew-process-server-reader", daemon=True
        )
        self._reader.start()

    # ------------------------------------------------------------------ start and stop

    @staticmethod
    def _spawn(
        env: Mapping[str, str] | None, python: str | None
    ) -> tuple[subprocess.Popen, Connection]:
        ours, theirs = socket.socketpair()
        environment = {**os.environ, **(env or {})}
        path = [p for p in sys.path if p]
        if environment.get("PYTHONPATH"):
            path.append(environment["PYTHONPATH"])
        environment["PYTHONPATH"] = os.pathsep.join(path)
        fd = theirs.fileno()
        try:
            process = subprocess.Popen(
                [
                    python or sys.executable,
                    "-m",
                    "dew_pipe.inference.servers.process_worker",
                    str(fd),
                ],
                pass_fds=(fd,),
                env=environment,
                stdin=subprocess.DEVNULL,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return process, Connection(ours.detach())

    def _handshake(self, setup: dict[str, Any], timeout: float) -> tuple:
        try:
            self._connection.send(setup)
            arrived = self._connection.poll(timeout)
            message = self._connection.recv() if arrived else None
        except (EOFError, OSError):
            message = None
            arrived = True
        if not arrived:
            raise RuntimeError(
                f"the rollout server process did not start within start_timeout={timeout} s"
            )
        if message is None:
            code = self._process.wait(timeout=_CLOSE_S)
            raise RuntimeError(
                f"the rollout server process exited with code {code} during its start "
                "(see its stderr above)"
            )
        if message[0] == "failed":
            raise message[1]
        return message

    def _kill(self) -> None:
        if self._process.poll() is None:
            self._process.kill()
        self._process.wait()
        self._connection.close()

    def close(self) -> None:
        """Closes the child's server (unfinished draws fail) and waits for it to exit.

        Idempotent. A child that does not exit within 30 s is killed.

        Raises:
            RuntimeError: called from the reader thread (a draw's done callback).
        """
        if threading.current_thread() is self._reader:
            raise RuntimeError("ProcessRolloutServer.close was called from a draw's callback")
        with self._cond:
            if self._closing:
                already = True
            else:
                already, self._closing = False, True
        if not already:
            self._send(("close",), quiet=True)
            try:
                self._process.wait(timeout=_CLOSE_S)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._reader.join()
        self._fail_all(RuntimeError("the rollout server was closed before this request finished"))

    def __enter__(self) -> ProcessRolloutServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ RolloutServer

    @property
    def version(self) -> int:
        """The weights version new draws are served under."""
        return self._version

    def submit(
        self,
        prompt_ids: Sequence[int] | np.ndarray,
        max_new_tokens: int,
        *,
        seed: int | None = None,
    ) -> Future[Draw]:
        """Queues one draw in the child; returns its future at once.

        Blocks while ``queue + slots`` draws are unfinished, as `Server.submit` blocks on a
        full queue.

        Args:
            prompt_ids: the ids the model reads (1-D integers).
            max_new_tokens: the budget (>= 1).
            seed: ``[0, 2**32)``; None takes the next seed of the child server's stream.

        Returns:
            A future `Draw`; it fails with ValueError for a prompt the server cannot serve
            (empty, ids outside the vocabulary, too long), with RuntimeError when the
            server closes or its process dies first. Cancel it to stop the draw.

        Raises:
            TypeError / ValueError: a bad budget, seed or prompt dtype.
            RuntimeError: the server is closed, or its process died.
        """
        budget = check_int("max_new_tokens", max_new_tokens, minimum=1)
        prompt = prompt_array(prompt_ids)
        seed = request_seed(seed)
        future: Future[Draw] = Future()
        with self._cond:
            self._wait_for_room("submit")
            rid = next(self._ids)
            self._pending[rid] = future
        future.add_done_callback(lambda done: self._on_done(rid, done))
        self._send(("submit", rid, prompt, budget, seed))
        return future

    def submit_many(
        self,
        prompts: Sequence[Sequence[int] | np.ndarray],
        max_new_tokens: int,
        *,
        seeds: Sequence[int | None] | None = None,
    ) -> list[Future[Draw]]:
        """Queues several draws in the child; the same as `submit` on each in order.

        The batch crosses the socket as one message and the child queues it with
        `Server.submit_many`, so an idle child sees it whole. Blocks while the child has
        no room (``queue + slots`` unfinished draws), sending the batch in parts as room
        frees.

        Args:
            prompts: the prompts, each 1-D integer ids.
            max_new_tokens: the budget of every draw (>= 1).
            seeds: one per prompt (entries ``[0, 2**32)`` or None); None: every draw takes
                the next seed of the child server's stream.

        Returns:
            One future `Draw` per prompt, in order; each fails as `submit`'s would.

        Raises:
            TypeError / ValueError: a bad budget, a prompt of a non-integer dtype, a bad
                seed, or ``seeds`` of another length (named by index); nothing is sent
                then.
            RuntimeError: the server is closed or its process died; or the child has no
                room and this was called from a draw's callback.
        """
        budget = check_int("max_new_tokens", max_new_tokens, minimum=1)
        arrays, checked = batch_requests(prompts, seeds)
        futures: list[Future[Draw]] = []
        start = 0
        while start < len(arrays):
            with self._cond:
                room = self._wait_for_room("submit_many")
                part = range(start, min(len(arrays), start + room))
                rids = [next(self._ids) for _ in part]
                batch = [Future() for _ in part]
                self._pending.update(zip(rids, batch, strict=True))
            for rid, future in zip(rids, batch, strict=True):
                future.add_done_callback(lambda done, rid=rid: self._on_done(rid, done))
            self._send(
                (
                    "submit_many",
                    rids,
                    [arrays[i] for i in part],
                    budget,
                    [checked[i] for i in part],
                )
            )
            futures.extend(batch)
            start = part.stop
        return futures

    def load(self, variables: Any, version: int) -> Future[int]:
        """Serves ``variables`` as ``version`` from the child's next decode step on.

        The variables are copied to host memory and sent before this returns (the caller
        may donate its arrays then), ahead of every later request, so draws submitted
        after the call start on the new weights; ``version`` moves at once. Draws in
        flight continue on the new weights, keeping the oldest version that produced
        their ids.

        Args:
            variables: ``{"params": ...}`` (or a ``TrainState``), any floating precision.
            version: the version to serve it as (an int >= 0).

        Returns:
            A future resolved with ``version`` once the child serves it; it fails with
            RuntimeError when the child could not apply it or died first.

        Raises:
            TypeError / ValueError: a tree that does not match the served one (naming the
                leaf), a bad version.
            RuntimeError: the server is closed or its process died, or called from a
                draw's callback.
        """
        version = check_int("version", version, minimum=0)
        variables = variables_of(variables, "variables")
        check_tree(self._signature, variables)
        if threading.current_thread() is self._reader:
            raise RuntimeError("ProcessRolloutServer.load was called from a draw's callback")
        host = jax.device_get(variables)
        future: Future[int] = Future()
        with self._cond:
            self._check_open()
            token = next(self._ids)
            self._pushes[token] = (future, version)
        # Under the send lock: no later submit can overtake the push on the socket.
        with self._send_lock:
            try:
                self._connection.send(("load", token, host, version))
            except (OSError, EOFError, ValueError) as error:
                with self._cond:
                    self._pushes.pop(token, None)
                raise RuntimeError("the rollout server process is gone") from error
            self._version = version
        return future

    def counters(self) -> ServerCounters:
        """The child server's counters (`Server.counters`).

        Raises:
            RuntimeError: the server is closed or its process died.
        """
        return self._request("counters")[2]

    # ------------------------------------------------------------------ internals

    def _check_open(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the rollout server process failed: {self._error}") from (
                self._error
            )
        if self._closing:
            raise RuntimeError("the rollout server is closed")

    def _wait_for_room(self, caller: str) -> int:
        """Under ``_cond``: waits while the child holds ``queue + slots`` unfinished draws;
        returns how many more fit."""
        self._check_open()
        while len(self._pending) >= self._queue + self._slots:
            if threading.current_thread() is self._reader:
                raise RuntimeError(
                    f"the rollout server's queue is full and {caller} was called from a "
                    "draw's callback, which cannot wait for the queue to drain"
                )
            self._cond.wait()
            self._check_open()
        return self._queue + self._slots - len(self._pending)

    def _send(self, message: tuple, quiet: bool = False) -> None:
        with self._send_lock:
            try:
                self._connection.send(message)
            except (OSError, EOFError, ValueError) as error:
                if quiet:
                    return
                # The reader thread sees the same broken socket and fails everything.
                raise RuntimeError("the rollout server process is gone") from error

    def _request(self, kind: str, *args: Any) -> tuple:
        if threading.current_thread() is self._reader:
            raise RuntimeError(
                f"ProcessRolloutServer.{kind} was called from a draw's callback, which the "
                "answer would have to wait for"
            )
        reply = _Reply()
        with self._cond:
            self._check_open()
            token = next(self._ids)
            self._replies[token] = reply
        try:
            self._send((kind, token, *args))
        except RuntimeError:
            with self._cond:
                self._replies.pop(token, None)
            raise
        reply.done.wait()
        if reply.error is not None:
            raise RuntimeError(f"ProcessRolloutServer.{kind}: {reply.error}") from reply.error
        return reply.message

    def _on_done(self, rid: int, future: Future[Draw]) -> None:
        if future.cancelled():
            self._send(("cancel", rid), quiet=True)

    def _read(self) -> None:
        closed = False
        while not closed:
            try:
                message = self._connection.recv()
            except (EOFError, OSError):
                break
            draws = []  # a run of finished draws, delivered under one lock
            for item in message[1] if message[0] == "batch" else (message,):
                if item[0] in _DRAW_KINDS:
                    draws.append(item)
                    continue
                self._deliver_draws(draws)
                draws = []
                if item[0] == "closed":
                    closed = True
                    break
                self._deliver(item)
            self._deliver_draws(draws)
        with self._cond:
            closing = self._closing
        if not closing:
            code = self._process.wait()
            self._fail_all(RuntimeError(f"the rollout server process exited with code {code}"))
        self._connection.close()

    def _deliver_draws(self, messages: list[tuple]) -> None:
        """Resolves the futures of finished, failed or cancelled draws, in order (one lock
        and one wake-up of blocked submitters for the lot)."""
        if not messages:
            return
        with self._cond:
            futures = [self._pending.pop(message[1], None) for message in messages]
            self._cond.notify_all()  # room for a blocked submit
        for message, future in zip(messages, futures, strict=True):
            if future is None or message[0] == "cancelled":
                continue
            try:
                if message[0] == "draw":
                    future.set_result(message[2])
                else:
                    future.set_exception(message[2])
            except InvalidStateError:  # cancelled here while the child finished it
                pass

    def _deliver(self, message: tuple) -> None:
        kind, key = message[0], message[1]
        if kind in _DRAW_KINDS:
            self._deliver_draws([message])
            return
        if kind in ("loaded", "load_failed"):
            with self._cond:
                future, version = self._pushes.pop(key, (None, None))
            if future is None:
                return
            with contextlib.suppress(InvalidStateError):
                if kind == "loaded":
                    future.set_result(version)
                else:
                    error = RuntimeError(f"ProcessRolloutServer.load to version {version} failed")
                    error.__cause__ = message[2]
                    future.set_exception(error)
            return
        with self._cond:
            reply = self._replies.pop(key, None)
        if reply is not None:
            reply.message = message
            reply.done.set()

    def _fail_all(self, error: RuntimeError) -> None:
        """Fails every unfinished future and waiting request; later requests fail too."""
        with self._cond:
            if self._error is None and not self._closing:
                self._error = error
            futures, self._pending = list(self._pending.values()), {}
            replies, self._replies = list(self._replies.values()), {}
            pushes, self._pushes = [f for f, _ in self._pushes.values()], {}
            self._cond.notify_all()
        for future in futures:
            try:
                future.set_exception(error)
            except InvalidStateError:
                continue
        for reply in replies:
            reply.error = error
            reply.done.set()
        for future in pushes:
            with contextlib.suppress(InvalidStateError):
                future.set_exception(error)
